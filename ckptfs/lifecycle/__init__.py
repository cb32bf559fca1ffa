"""The training-run lifecycle on top of the protocol: :class:`~.manager.CheckpointManager`,
retention and the running-best pool (:mod:`.retention`), garbage collection (:mod:`.gc`),
write-once artifacts (:mod:`.artifacts`), create-only records (:mod:`.records`), resume
provenance (:mod:`.provenance`) and per-rank RNG state (:mod:`.rng`).

Imports the protocol, format and storage layers; never the CLI.
"""
