"""Storage: the narrow interface ckptfs owns (:mod:`.base`), the backend table
(:mod:`.backends`) and the single fsspec adapter (:mod:`.fsspec`)."""

from ckptfs.storage.backends import BACKENDS, BackendSpec, spec_for
from ckptfs.storage.base import Capabilities, Entry, Storage
from ckptfs.storage.fsspec import FsspecStorage

__all__ = ["BACKENDS", "BackendSpec", "Capabilities", "Entry", "FsspecStorage", "Storage",
           "spec_for"]
