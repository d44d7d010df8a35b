"""Bindings to external systems (stores, model backends) behind small ports."""
