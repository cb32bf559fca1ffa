"""The commit protocol over the narrow storage interface: writing an attempt and creating its
marker last (:mod:`.commit`), resolving committed steps and "latest" by listing
(:mod:`.resolve`), verified loading (:mod:`.reader`) and the user-facing
:class:`~ckptfs.protocol.store.CheckpointStore` (:mod:`.store`).

Imports :mod:`ckptfs.format` and :mod:`ckptfs.storage`; never the lifecycle, the CLI or an
integration.
"""
