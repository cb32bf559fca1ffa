"""The records of `ckptfs.torch_checkpointing`: a file's sum (its size and block digests, in
its sidecar), a commit marker (`CommitRecord`), the hasher that makes them, and the names
they live under.  No I/O, no torch_checkpointing."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.hashing import new_hasher

#: Names this storage keeps beside the user's files; never listed, never writable by callers.
HIDDEN_PREFIX = ".ckptfs-"
MARKER_PREFIX = ".ckptfs-commit."
SUM_PREFIX = ".ckptfs-sum."
KEEP_NAME = ".ckptfs-dir"
MARKER_FORMAT = "ckptfs-torch-checkpointing-commit"
SUM_FORMAT = "ckptfs-torch-checkpointing-sum"
FORMAT_VERSION = 1
#: Digests are kept per block of this many bytes, so a ranged read checks only the blocks it
#: touches.
DEFAULT_BLOCK_SIZE = 8 * 1024 * 1024


@dataclass(frozen=True)
class FileSum:
    """A file's size and the digests of its blocks (``"algorithm:hex"`` each)."""

    size: int
    blocks: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"size": self.size, "blocks": list(self.blocks)}


@dataclass(frozen=True)
class CommitRecord:
    """A committed logical directory: the marker's content."""

    target: str              # the logical directory, relative to the root
    source: str              # where its files are
    block_size: int
    files: dict[str, FileSum]  # relative to the directory
    dirs: frozenset[str]       # every subdirectory (relative), "" excluded

    def to_bytes(self) -> bytes:
        doc = {"format": MARKER_FORMAT, "version": FORMAT_VERSION, "target": self.target,
               "source": self.source, "block_size": self.block_size,
               "files": {k: v.to_json() for k, v in sorted(self.files.items())},
               "dirs": sorted(self.dirs)}
        return json.dumps(doc, sort_keys=True).encode()

    @staticmethod
    def parse(data: bytes, where: str) -> CommitRecord:
        try:
            doc = json.loads(data)
            if doc.get("format") != MARKER_FORMAT or doc.get("version") != FORMAT_VERSION:
                raise ValueError(f"format {doc.get('format')!r} version {doc.get('version')!r}")
            files = {str(k): parse_sum(v) for k, v in doc["files"].items()}
            return CommitRecord(str(doc["target"]), str(doc["source"]), int(doc["block_size"]),
                                files, frozenset(str(d) for d in doc["dirs"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptCheckpointError(
                f"{where}: unreadable commit marker ({exc}); the committed directory cannot "
                "be trusted: delete it (rmdir) and save again", path=where) from exc

    def child_names(self, rel: str) -> list[str]:
        prefix = rel + "/" if rel else ""
        names = {p[len(prefix):].split("/", 1)[0]
                 for p in (*self.files, *self.dirs) if p.startswith(prefix) and p != rel}
        return sorted(n for n in names if n)


def parse_sum(v: Any) -> FileSum:
    return FileSum(int(v["size"]), tuple(str(b) for b in v["blocks"]))


def parent_key(key: str) -> str:
    return key.rsplit("/", 1)[0] if "/" in key else ""


def base_name(key: str) -> str:
    return key.rsplit("/", 1)[-1]


def join_key(a: str, b: str) -> str:
    return f"{a}/{b}" if a and b else (a or b)


def marker_key(key: str) -> str:
    return join_key(parent_key(key), MARKER_PREFIX + base_name(key))


def sum_key(key: str) -> str:
    return join_key(parent_key(key), SUM_PREFIX + base_name(key))



def sidecar_bytes(s: FileSum, block_size: int) -> bytes:
    """The sidecar of a file: its sum and the block size it was hashed with."""
    return json.dumps({"format": SUM_FORMAT, "version": FORMAT_VERSION,
                       "block_size": block_size, **s.to_json()}).encode()


class BlockHasher:
    """Digests of consecutive ``block_size`` blocks of a stream of bytes."""

    def __init__(self, algorithm: str, block_size: int) -> None:
        self.algorithm, self.block_size = algorithm, block_size
        self.blocks: list[str] = []
        self.size = 0
        self._h = new_hasher(algorithm)
        self._fill = 0

    def update(self, data: memoryview) -> None:
        while len(data):
            take = min(len(data), self.block_size - self._fill)
            self._h.update(data[:take])
            self._fill += take
            self.size += take
            data = data[take:]
            if self._fill == self.block_size:
                self._finish_block()

    def _finish_block(self) -> None:
        self.blocks.append(f"{self.algorithm}:{self._h.hexdigest()}")
        self._h = new_hasher(self.algorithm)
        self._fill = 0

    def result(self) -> FileSum:
        if self._fill:
            self._finish_block()
        return FileSum(self.size, tuple(self.blocks))

