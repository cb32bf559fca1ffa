"""The entries a manifest lists: whole files (`FileEntry`), chunked files (`ChunkedFileEntry`,
tiled by `Chunk` s whose list the file's digest binds) and references to chunks of other
attempts' files (`Reference`).  Pure: frozen dataclasses and the checks on them; the manifest
that lists them, and its bytes, is `ckptfs.format.manifest`.

Every file of a chunked format (docs/protocol.md §8, §9) is tiled by *chunks* (offset, length,
digest): the safetensors header is one chunk, each tensor's or item's bytes another.  Each byte
is hashed once, into its chunk's digest; the file's digest is the digest of its chunk list
(`chunk_list_digest`), so no second pass over the bytes is needed, and a ranged reader checks
exactly the chunks it reads.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.hashing import STORE_CHECKSUM_HEX, digest_bytes, parse_digest
from ckptfs.format.layout import CHECKPOINTS_DIR, step_dir_name

#: The optional per-file key holding the store's whole-object checksums (section 2.1).
STORE_CHECKSUMS_KEY = "store_checksums"


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative to the attempt directory
    size: int
    digest: str  # "algorithm:hex"
    #: Optional (docs/protocol.md section 2.1): ``(algorithm, hex)`` of the whole-object
    #: checksums the object store keeps (``ckptfs.format.hashing.STORE_CHECKSUMS``), computed
    #: while writing, for ``verify(remote=True)``.  Older readers ignore the key.
    store_checksums: tuple[tuple[str, str], ...] = field(default=(), kw_only=True)

    @property
    def algorithm(self) -> str:
        return self.digest.split(":", 1)[0]


def store_checksums_doc(entry: FileEntry) -> dict[str, Any]:
    """The optional ``store_checksums`` key of a file entry (nothing when it has none, so a
    manifest without them is byte-identical to one written before the key existed)."""
    if not entry.store_checksums:
        return {}
    return {STORE_CHECKSUMS_KEY: dict(entry.store_checksums)}


def decode_store_checksums(raw: Mapping[str, Any], path: str) -> tuple[tuple[str, str], ...]:
    """The ``store_checksums`` of a file entry: an object of ``name: hex``.  Names this reader
    does not know are ignored (a newer writer's); a known name with a malformed value, or a
    value that is not an object, is a malformed manifest (``TypeError``, reported by the
    decoder as `CorruptCheckpointError`)."""
    value = raw.get(STORE_CHECKSUMS_KEY)
    if value is None:
        return ()
    if not isinstance(value, dict):
        raise TypeError(f"file {path!r}: {STORE_CHECKSUMS_KEY!r} is not an object")
    out = []
    for name, hexdigest in sorted(value.items()):
        width = STORE_CHECKSUM_HEX.get(name)
        if width is None:
            continue
        if (not isinstance(hexdigest, str) or len(hexdigest) != width
                or any(c not in "0123456789abcdef" for c in hexdigest)):
            raise TypeError(f"file {path!r}: store checksum {name} is not {width} hex digits")
        out.append((name, hexdigest))
    return tuple(out)


# ----------------------------------------------------------------------------------------------
# Chunks and their digests


@dataclass(frozen=True)
class Chunk:
    """``length`` bytes at ``offset`` of a file, whose digest (hex, the file's algorithm) is
    ``digest``."""

    offset: int
    length: int
    digest: str


def chunk_list_text(chunks: Iterable[Chunk]) -> bytes:
    """The canonical text a chunked file's digest is taken over: one ``"<offset> <length>
    <hex>\\n"`` line per chunk, in file order (docs/protocol.md, format v2)."""
    return "".join(f"{c.offset} {c.length} {c.digest}\n" for c in chunks).encode("ascii")


def chunk_list_digest(algorithm: str, chunks: Iterable[Chunk]) -> str:
    """``"<algorithm>:<hex>"`` of `chunk_list_text`: the file digest of a chunked format."""
    return digest_bytes(algorithm, chunk_list_text(chunks))


@dataclass(frozen=True)
class ChunkedFileEntry(FileEntry):
    """A chunked manifest's entry: ``digest`` is the digest of the chunk list, which tiles the
    file; ``rank`` the rank that wrote it (sharded formats; ``None`` otherwise and for
    ``dcp.msgpack``)."""

    chunks: tuple[Chunk, ...] = ()
    rank: int | None = None

    def chunk_at(self, offset: int, length: int) -> Chunk | None:
        """The chunk that starts at ``offset`` and is ``length`` long, or ``None``."""
        lo, hi = 0, len(self.chunks)
        while lo < hi:  # chunks are sorted by offset (checked on decode)
            mid = (lo + hi) // 2
            if self.chunks[mid].offset < offset:
                lo = mid + 1
            else:
                hi = mid
        while lo < len(self.chunks) and self.chunks[lo].offset == offset:
            c = self.chunks[lo]  # several only where zero-length chunks share the offset
            if c.length == length:
                return c
            lo += 1
        return None


def make_entry(path: str, size: int, algorithm: str, chunks: list[Chunk],
               rank: int | None, *, store_checksums: tuple[tuple[str, str], ...] = ()
               ) -> ChunkedFileEntry:
    """The manifest entry of a chunked file, after checking that ``chunks`` tile it;
    ``store_checksums``: what the writer computed of the store's own checksums
    (docs/remote-verify.md)."""
    check_tiling(chunks, size, where=path)
    entry = ChunkedFileEntry(path, size, chunk_list_digest(algorithm, chunks), tuple(chunks),
                             rank, store_checksums=store_checksums)
    object.__setattr__(entry, _BOUND, True)  # not a field: a copy or a replace() has no mark
    return entry


#: The mark `make_entry` leaves on the entries it makes (see `is_bound`).
_BOUND = "_bound_by_make_entry"


def is_bound(entry: FileEntry) -> bool:
    """Whether ``entry`` was made by `make_entry` (not copied, replaced or built by hand):
    its chunks tile it and its digest is their list's (`chunk_list_digest`), as a
    decoder's `bound_entry` would find, so a writer's check of its own manifest skips
    recomputing them."""
    return bool(entry.__dict__.get(_BOUND, False))


def check_tiling(chunks: list[Chunk] | tuple[Chunk, ...], size: int, *, where: str) -> None:
    pos = 0
    for c in chunks:
        if c.offset != pos or c.length < 0:
            raise CorruptCheckpointError(
                f"{where}: chunks do not tile the file (chunk at {c.offset}, expected {pos})")
        pos += c.length
    if pos != size:
        raise CorruptCheckpointError(f"{where}: chunks cover {pos} B of a {size} B file")


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def decode_chunks(raw: Any, algo: str, path: str) -> list[Chunk]:
    """A manifest's chunk list, ``[[offset, length, hex], ...]`` (formats v2, v3, v4): each an
    array of two ints and a hex digest of ``algo`` (``TypeError``/``ValueError`` otherwise,
    which the manifest decoder turns into `CorruptCheckpointError`)."""
    if not isinstance(raw, list):
        raise TypeError(f"file {path!r}: 'chunks' is not a list")
    chunks = []
    for rc in raw:
        if (not isinstance(rc, list) or len(rc) != 3 or not _is_int(rc[0])
                or not _is_int(rc[1]) or not isinstance(rc[2], str)):
            raise TypeError(f"file {path!r}: a chunk is not [offset, length, hex]")
        parse_digest(f"{algo}:{rc[2]}")
        chunks.append(Chunk(rc[0], rc[1], rc[2]))
    return chunks


def bound_entry(path: str, size: int, digest: str, algo: str, chunks: list[Chunk],
                rank: int | None, *, where: str,
                store_checksums: tuple[tuple[str, str], ...] = ()) -> ChunkedFileEntry:
    """The manifest entry of a chunked file, after checking that ``chunks`` tile it and that
    ``digest`` is the digest of their list (`CorruptCheckpointError` naming ``where``)."""
    check_tiling(chunks, size, where=f"{where}: {path}")
    entry = ChunkedFileEntry(path, size, digest, tuple(chunks), rank,
                             store_checksums=store_checksums)
    if chunk_list_digest(algo, chunks) != entry.digest:
        raise CorruptCheckpointError(
            f"{where}: file {path!r}: its digest does not match its chunk list")
    return entry


# ----------------------------------------------------------------------------------------------
# The table of rank files (the "rank-metadata" feature)

#: A table row's fixed part: rank (u32), flags (u8), file size (u64), index size (u64), all
#: big-endian; two raw digests follow.
RANK_ROW_HEAD_BYTES = 21


def digest_width(algorithm: str) -> int:
    """Bytes of one raw digest of ``algorithm``."""
    return (len(digest_bytes(algorithm, b"")) - len(algorithm) - 1) // 2


def rank_row_bytes(algorithm: str) -> int:
    """Width of one row of the table of rank files for ``algorithm``."""
    return RANK_ROW_HEAD_BYTES + 2 * digest_width(algorithm)


@dataclass(frozen=True)
class RankTable:
    """What a format v5 manifest says about its table of rank files (its ``rank_table``):
    ``rows_per_block`` rows per block (the last holds the rest), how many ranks wrote a file,
    and the bytes of their files and index documents."""

    rows_per_block: int
    rank_files: int
    rank_bytes: int

    def as_doc(self) -> dict[str, Any]:
        return {"rows_per_block": self.rows_per_block, "rank_files": self.rank_files,
                "rank_bytes": self.rank_bytes}


# ----------------------------------------------------------------------------------------------
# References (the "references" feature)


@dataclass(frozen=True)
class Reference:
    """Chunks of a file another attempt of the run holds, used by this checkpoint under the
    name ``path``.  ``chunks`` are sorted by offset, disjoint, inside ``size``; the first is the
    file's safetensors header chunk (offset 0)."""

    path: str
    step: int
    attempt: str
    source: str
    size: int
    algorithm: str
    chunks: tuple[Chunk, ...]

    @property
    def location(self) -> str:
        """The file's path relative to the run root."""
        return f"{CHECKPOINTS_DIR}/{step_dir_name(self.step)}/{self.attempt}/{self.source}"

    @property
    def attempt_dir(self) -> str:
        return f"{CHECKPOINTS_DIR}/{step_dir_name(self.step)}/{self.attempt}"

    @property
    def used_bytes(self) -> int:
        """Bytes of the file this checkpoint reads (its chunks)."""
        return sum(c.length for c in self.chunks)

    def chunk_at(self, offset: int, length: int) -> Chunk | None:
        for c in self.chunks:
            if c.offset == offset and c.length == length:
                return c
        return None

    def as_doc(self) -> dict[str, Any]:
        return {"path": self.path, "step": self.step, "attempt": self.attempt,
                "source": self.source, "size": self.size, "algorithm": self.algorithm,
                "chunks": [[c.offset, c.length, c.digest] for c in self.chunks]}


@dataclass(frozen=True)
class ReferencedFile(ChunkedFileEntry):
    """A reference seen as a chunked file (what `Manifest.chunked` returns for a reference's
    ``path``): ``location`` (from the run root) is where its bytes are read, and ``chunks``
    are only the chunks this checkpoint uses (the header chunk first, then one per item it
    reads there): sorted and disjoint, not a tiling."""

    location: str = ""

    @classmethod
    def of(cls, ref: Reference) -> ReferencedFile:
        return cls(ref.path, ref.size, chunk_list_digest(ref.algorithm, ref.chunks),
                   ref.chunks, None, ref.location)
