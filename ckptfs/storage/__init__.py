"""Storage: the narrow interface ckptfs owns, with its optional capabilities and the wrapper base
(:mod:`.base`), the backend table (:mod:`.backends`), the single fsspec adapter
(:mod:`.fsspec`), and the wrappers of this layer: retries (:mod:`.retry`) and a sub-root
(:mod:`.sub`)."""

from ckptfs.storage.backends import BACKENDS, BackendSpec, spec_for
from ckptfs.storage.base import Capabilities, Entry, Storage
from ckptfs.storage.fsspec import FsspecStorage

__all__ = ["BACKENDS", "BackendSpec", "Capabilities", "Entry", "FsspecStorage", "Storage",
           "spec_for"]
