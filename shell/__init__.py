"""Imperative shell: Ray workers, store I/O, trainers and entry points."""
