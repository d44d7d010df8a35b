"""Pure, deterministic core of the data plane (no I/O). Public names are re-exported here."""
