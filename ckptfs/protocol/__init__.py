"""The commit protocol over the narrow storage interface: writing an attempt and creating its
marker last (`.commit`), resolving committed steps and "latest" by listing
(`.resolve`), verified loading (`.reader`) and the user-facing
`CheckpointStore` (`.store`).

Imports `ckptfs.format` and `ckptfs.storage`; never the lifecycle, the CLI or an
integration.
"""
