"""The two signals a built-in extension codec raises (``ckptfs.format.extensions`` turns them
into ckptfs's typed errors).  A module of their own so that the codecs of optional packages
(``ckptfs.format.extensions_numpy``) raise them without importing the registry that imports
them."""

from __future__ import annotations

__all__ = ["Malformed", "Refused"]


class Malformed(Exception):
    """Raised by a built-in decoder for a payload no writer produces (a hostile or corrupt
    file): reported as `CorruptCheckpointError`, not as a refused decode."""


class Refused(Exception):
    """Raised by a built-in encoder for a value of its type that it cannot store (an object
    array): reported as `UnsupportedValueError` naming the key path."""
