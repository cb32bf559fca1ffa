"""Storage: the narrow interface ckptfs owns, with its optional capabilities and the wrapper base
(`.base`), the backend table (`.backends`), the single fsspec adapter
(`.fsspec`), and the wrappers of this layer: retries (`.retry`) and a sub-root
(`.sub`)."""

from ckptfs.storage.backends import BACKENDS, BackendSpec, spec_for
from ckptfs.storage.base import Capabilities, Entry, Storage
from ckptfs.storage.fsspec import FsspecStorage

__all__ = ["BACKENDS", "BackendSpec", "Capabilities", "Entry", "FsspecStorage", "Storage",
           "spec_for"]
