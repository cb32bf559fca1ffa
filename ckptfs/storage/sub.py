"""A storage rooted at a prefix inside another storage.

Run artifacts (``artifacts/<name>/``) and the Lightning integration's per-path stores reuse the
whole commit protocol as stores of their own, one level down.  The sub-storage is a
`StorageWrapper` that only moves paths (its two hooks); everything
else is its parent's: the retries (`Retrying`), the write-memory
budget (``capabilities.stream_buffer_bytes`` is data, copied), ranged reads, local files for
``mmap=True``, and every other optional capability, each offered exactly where the parent
offers it.
"""

from __future__ import annotations

from ckptfs.storage.base import Entry, Storage, StorageWrapper


class SubStorage(StorageWrapper):
    """``parent`` seen from ``prefix``: path ``p`` here is ``<prefix>/p`` there."""

    def __init__(self, parent: Storage, prefix: str) -> None:
        super().__init__(parent)
        self.prefix = prefix.strip("/")
        self.url = f"{parent.url}/{self.prefix}" if self.prefix else parent.url

    @property
    def parent(self) -> Storage:
        return self.inner

    def inner_path(self, path: str) -> str:
        if not self.prefix:
            return path
        return f"{self.prefix}/{path}" if path else self.prefix

    def outer_entry(self, entry: Entry) -> Entry:
        name = entry.name
        if not self.prefix:
            return entry
        if name.startswith(self.prefix + "/"):
            name = name[len(self.prefix) + 1:]
        elif name == self.prefix:
            name = ""
        return Entry(name, entry.size, entry.is_dir, entry.is_link)

    def __repr__(self) -> str:
        return f"SubStorage({self.url!r})"
