"""A backend under test: a fresh run-root URL plus a raw *backdoor* to the same storage.

The backdoor is a separate fsspec filesystem instance (instance and listing caches off) that
reads and writes storage directly, never through ckptfs: conformance tests use it to inspect what
ckptfs wrote and to plant corrupted, partial or hostile objects, as zarr's store tests do with
their raw ``set``/``get`` fixtures.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import fsspec

from ckptfs.protocol.store import CheckpointStore
from ckptfs.protocol.store import open as open_store


@dataclass
class Backend:
    name: str
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)
    #: Environment variables a subprocess needs to reach this backend (e.g. for gcsfs).
    env: Mapping[str, str] = field(default_factory=dict)
    #: Protocol-level facts a test may need (e.g. whether exclusive create holds across
    #: processes); derived from the store's capabilities unless overridden.
    raw_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        opts = {**self.options, **self.raw_options, "skip_instance_cache": True}
        if self.protocol not in ("file", "memory"):
            opts.setdefault("use_listings_cache", False)
        self.raw_fs, self.raw_root = fsspec.core.url_to_fs(self.url, **opts)
        self.raw_root = self.raw_root.rstrip("/")

    @property
    def protocol(self) -> str:
        return fsspec.core.split_protocol(self.url)[0] or "file"

    def open(self, **kwargs: Any) -> CheckpointStore:
        """A new store on the run root (a new client: nothing cached from earlier stores)."""
        return open_store(self.url, **{**self.options, **kwargs})

    def sibling(self, suffix: str | None = None) -> Backend:
        """Another fresh run root on the same storage."""
        return Backend(self.name, f"{self.url}-{suffix or uuid.uuid4().hex[:8]}", self.options,
                       self.env, self.raw_options)

    # -- the backdoor (paths relative to the run root) ----------------------------------------

    def _p(self, rel: str) -> str:
        return f"{self.raw_root}/{rel}" if rel else self.raw_root

    def raw_read(self, rel: str) -> bytes:
        return bytes(self.raw_fs.cat_file(self._p(rel)))

    def raw_write(self, rel: str, data: bytes) -> None:
        if self.protocol == "file":
            self.raw_fs.makedirs(self.raw_fs._parent(self._p(rel)), exist_ok=True)
        self.raw_fs.pipe_file(self._p(rel), data)

    def raw_delete(self, rel: str) -> None:
        self.raw_fs.rm(self._p(rel), recursive=True)

    def raw_exists(self, rel: str) -> bool:
        self.raw_fs.invalidate_cache()
        return bool(self.raw_fs.exists(self._p(rel)))

    def raw_files(self, rel: str = "") -> dict[str, int]:
        """Every file under ``rel``: relative path -> size."""
        self.raw_fs.invalidate_cache()
        try:
            found = self.raw_fs.find(self._p(rel), detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        root = self.raw_root.lstrip("/") + "/"
        for name, info in found.items():
            if info.get("type") == "directory":
                continue
            key = str(name).lstrip("/")
            out[key[len(root):] if key.startswith(root) else key] = int(info.get("size") or 0)
        return out


def unique_name(prefix: str = "run") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"
