"""Per-backend facts as data: capabilities, the package that implements the protocol, and the
storage options ckptfs sets by default (listing caches off, instance cache off).

Looked up once, by the fsspec filesystem's own protocol names, when a store is opened; the rest
of ckptfs reads the resulting :class:`~ckptfs.storage.base.Capabilities` and never inspects URLs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .base import Capabilities


@dataclass(frozen=True)
class BackendSpec:
    capabilities: Capabilities
    package: str | None
    #: Options merged under the user's (the user's win): keep listings fresh, so that a commit by
    #: another process is seen at once.
    default_options: Mapping[str, Any] = field(default_factory=dict)
    #: Options for streaming reads (``open(path, "rb", **read_options)``).
    read_options: Mapping[str, Any] = field(default_factory=dict)
    #: The weaker guarantee, stated when exclusive create is not enforced across processes.
    caveat: str = ""
    #: A file being written is visible (half-written) under its name at once, so an aborted
    #: write must delete it (fsspec's memory filesystem).
    partial_visible: bool = False
    #: Reads return one shared file object per path (memory): read through ``cat_file``.
    shared_read_handles: bool = False


_LOCAL = BackendSpec(
    Capabilities("file", exclusive_create="os_excl", atomic_rename=True, fsync=True,
                 empty_create_safe=True, real_directories=True, shared=True),
    package=None,
)
_MEMORY = BackendSpec(
    Capabilities("memory", exclusive_create="process_lock", atomic_rename=False, fsync=False,
                 empty_create_safe=True, real_directories=False, shared=False),
    package=None,
    partial_visible=True,
    shared_read_handles=True,
    caveat="memory:// is private to this process: exclusive create is enforced by a lock in "
    "this process only",
)
_S3 = BackendSpec(
    Capabilities("s3", exclusive_create="server_precondition", atomic_rename=False, fsync=False,
                 empty_create_safe=False, real_directories=False, shared=True),
    package="s3fs",
    default_options={"use_listings_cache": False, "skip_instance_cache": True},
    read_options={"cache_type": "none"},
)
_GCS = BackendSpec(
    Capabilities("gs", exclusive_create="server_precondition", atomic_rename=False, fsync=False,
                 empty_create_safe=True, real_directories=False, shared=True),
    package="gcsfs",
    default_options={"skip_instance_cache": True, "use_listings_cache": False},
    read_options={"cache_type": "none"},
)
_AZURE = BackendSpec(
    Capabilities("az", exclusive_create="server_precondition", atomic_rename=False, fsync=False,
                 empty_create_safe=True, real_directories=False, shared=True),
    package="adlfs",
    default_options={"skip_instance_cache": True, "use_listings_cache": False},
    read_options={"cache_type": "none"},
)

#: fsspec protocol name -> spec.  Unknown protocols get a conservative spec (no exclusive create,
#: no rename), which the store reports when opened.
BACKENDS: dict[str, BackendSpec] = {
    "file": _LOCAL, "local": _LOCAL,
    "memory": _MEMORY,
    "s3": _S3, "s3a": _S3,
    "gs": _GCS, "gcs": _GCS,
    "az": _AZURE, "abfs": _AZURE, "abfss": _AZURE,
}


def spec_for(protocols: str | tuple[str, ...]) -> BackendSpec:
    names = (protocols,) if isinstance(protocols, str) else tuple(protocols)
    for name in names:
        if name in BACKENDS:
            return BACKENDS[name]
    return BackendSpec(
        Capabilities(names[0] if names else "unknown", exclusive_create="none",
                     atomic_rename=False, fsync=False, empty_create_safe=False,
                     real_directories=False, shared=True),
        package=None,
        caveat="this backend has no create-only write known to ckptfs: two writers racing on "
        "the same step can both 'commit'; the last marker wins and verify detects a mix",
    )
