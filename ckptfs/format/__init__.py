"""The on-storage format: pure names and layout (`.layout`), the one manifest model and the
commit marker with their codecs (`.manifest`), the entries a manifest lists (`.entries`), the
feature table (`.features`: a format version is a set of features) and the format table over it
(`.versions`), state serialization to safetensors + tagged msgpack (`.serialize`) and content
hashing (`.hashing`).

This layer does no storage I/O and imports nothing above it (only `ckptfs.errors`).
"""
