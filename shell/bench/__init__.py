"""Benchmarks: ``python -m shell.bench <name>`` measures and prints a table beside the baselines."""
