"""The training-run lifecycle on top of the protocol: `CheckpointManager`,
retention and the running-best pool (`.retention`), garbage collection (`.gc`),
write-once artifacts (`.artifacts`), create-only records (`.records`), resume
provenance (`.provenance`) and per-rank RNG state (`.rng`).

Imports the protocol, format and storage layers; never the CLI.
"""
