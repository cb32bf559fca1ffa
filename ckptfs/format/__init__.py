"""The on-storage format: pure names and layout (`.layout`), the manifest and commit-marker
codecs (`.manifest`), state serialization to safetensors + tagged msgpack
(`.serialize`) and content hashing (`.hashing`).

This layer does no storage I/O and imports nothing above it (only `ckptfs.errors`).
"""
