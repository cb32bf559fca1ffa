"""The on-storage format: pure names and layout (:mod:`.layout`), the manifest and commit-marker
codecs (:mod:`.manifest`), state serialization to safetensors + tagged msgpack
(:mod:`.serialize`) and content hashing (:mod:`.hashing`).

This layer does no storage I/O and imports nothing above it (only :mod:`ckptfs.errors`).
"""
