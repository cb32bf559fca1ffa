"""Hostile sharded checkpoints (format v2): the inputs of `.hostile` restated for the v2
layout, plus what only v2 has (``dcp.msgpack``, chunk tables, value documents inside the rank
files).  Each is planted with a *valid* marker and, where the attacker controls them, valid
digests (every chunk re-hashed), so only the reader's own checks can refuse it.  The expected
error of each is the one the v1 counterpart gets (`EXPECTED_ERRORS`): the same
hostile input, the same typed error, whatever the format.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable
from typing import Any, cast

import msgpack
import torch

from ckptfs.format.hashing import digest_bytes
from ckptfs.format.layout import StepPaths, new_attempt_name
from ckptfs.format.manifest import Marker
from ckptfs.format.sharded import METADATA_NAME, Chunk, chunk_list_digest
from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability.common import (
    Evil,
    plant_symlinked,
    raw_storage,
    state_for,
    store_on,
)
from ckptfs.testing.reliability.paths import save_v2

#: The rank file of the donor (one rank).
RANK_FILE = "rank-00000/data-0.safetensors"
#: A value stored as its own document in the rank file, long enough to hold the hostile
#: replacements planted in its place (same length: the chunk table stays valid).
LONG_VALUE = "trainer.note"


def donor_state() -> dict[str, Any]:
    state = state_for(0)
    state["trainer"]["note"] = "n" * 2000
    return state


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def fit(doc: dict[str, Any], length: int) -> bytes:
    """``doc`` as msgpack of exactly ``length`` bytes (padded by an extra key, which every
    decoder ignores)."""
    for n in range(length):
        data = packb({**doc, "zz": "z" * n})
        if len(data) == length:
            return data
        if len(data) > length:
            break
    raise ValueError(f"{doc!r:.80} does not fit in {length} bytes")  # pragma: no cover


class PlanterV2:
    """Writes hostile sharded checkpoints through the backdoor, each with a valid marker: the
    files' chunk tables are the donor's (re-hashed) where a file kept its size, else one chunk
    per file, so the manifest always decodes unless a case breaks it on purpose."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        donor = store_on(raw_storage(backend))
        info = save_v2(donor, 0, donor_state())
        self.algorithm = info.manifest.hash_algorithm
        self.files = {e.path: backend.raw_read(f"{info.path}/{e.path}")
                      for e in info.manifest.files}
        self.bounds = {e.path: [(c.offset, c.length) for c in e.chunks]  # type: ignore[attr-defined]
                       for e in info.manifest.files}
        self.dcp = msgpack.unpackb(self.files[METADATA_NAME], raw=False, strict_map_key=False)
        self.step = 1000

    def _hex(self, data: bytes) -> str:
        return digest_bytes(self.algorithm, data).split(":", 1)[1]

    def entry(self, path: str, data: bytes) -> dict[str, Any]:
        bounds = self.bounds.get(path)
        if bounds is None or sum(n for _, n in bounds) != len(data):
            bounds = [(0, len(data))]
        chunks = [Chunk(o, n, self._hex(data[o:o + n])) for o, n in bounds]
        return {"path": path, "size": len(data), "algorithm": self.algorithm,
                "digest": chunk_list_digest(self.algorithm, chunks),
                "rank": 0 if path.startswith("rank-") else None,
                "chunks": [[c.offset, c.length, c.digest] for c in chunks]}

    def entries(self, files: dict[str, bytes]) -> list[dict[str, Any]]:
        return [self.entry(p, d) for p, d in files.items()]

    def item(self, fqn: str) -> tuple[str, int, int]:
        """(file, offset, length) of a stored item, from the donor's ``dcp.msgpack``."""
        for name, _, path, off, length in self.dcp["storage_data"]:
            if name == fqn:
                return path, off, length
        raise KeyError(fqn)  # pragma: no cover - the donor holds it

    def plant(self, *, files: dict[str, bytes] | None = None,
              entries: list[dict[str, Any]] | None = None, manifest: bytes | None = None,
              doc_edit: Callable[[dict[str, Any]], None] | None = None,
              marker_edit: Callable[[dict[str, Any]], None] | None = None) -> int:
        self.step += 1
        step = self.step
        files = dict(self.files if files is None else files)
        attempt = new_attempt_name()
        adir = StepPaths(step).attempt_dir(attempt)
        for rel, data in files.items():
            self.backend.raw_write(f"{adir}/{rel}", data)
        doc: dict[str, Any] = {
            "schema": "ckptfs.manifest", "format_version": 2, "layout": "sharded",
            "step": step, "attempt": attempt, "created": "2026-01-01T00:00:00+00:00",
            "hash_algorithm": self.algorithm, "world_size": 1,
            "files": self.entries(files) if entries is None else entries,
            "metadata": {"tensor_count": 0}}
        if doc_edit is not None:
            doc_edit(doc)
        mbytes = manifest if manifest is not None else json.dumps(doc).encode()
        self.backend.raw_write(f"{adir}/MANIFEST.json", mbytes)
        marker = json.loads(Marker(step, attempt, digest_bytes("sha256", mbytes),
                                   max(1, len(mbytes)), "2026-01-01T00:00:00+00:00",
                                   {}).to_bytes())
        if marker_edit is not None:
            marker_edit(marker)
        self.backend.raw_write(StepPaths(step).marker, json.dumps(marker).encode())
        return step


def hostile_v2_cases(pl: PlanterV2, sentinel: str, *, local: bool
                     ) -> list[tuple[str, Callable[[], int], str]]:
    """(name, plant -> step, expected) for every hostile sharded input (module docstring).
    Nothing is read from ``pl`` until a case is planted, so the names and expectations are
    known without a planter (`hostile_v2_names`)."""
    cases: list[tuple[str, Callable[[], int], str]] = []

    def add(name: str, fn: Callable[[], int], expected: str = "typed") -> None:
        cases.append((name, fn, expected))

    def with_dcp(edit: Callable[[dict[str, Any]], None]) -> Callable[[], int]:
        def build() -> int:
            doc = json.loads(json.dumps(pl.dcp))  # deep copy (plain msgpack types)
            edit(doc)
            return pl.plant(files={**pl.files, METADATA_NAME: packb(doc)})
        return build

    def with_dcp_bytes(make: Callable[[], bytes]) -> Callable[[], int]:
        return lambda: pl.plant(files={**pl.files, METADATA_NAME: make()})

    def rank_bytes(offset: int, data: bytes) -> bytes:
        blob = bytearray(pl.files[RANK_FILE])
        blob[offset:offset + len(data)] = data
        return bytes(blob)

    def with_rank_bytes(make: Callable[[], tuple[int, bytes]]) -> Callable[[], int]:
        return lambda: pl.plant(files={**pl.files, RANK_FILE: rank_bytes(*make())})

    def with_value(make: Callable[[int], bytes]) -> Callable[[], int]:
        """The value document of LONG_VALUE replaced by ``make(length)`` (same length)."""
        def build() -> int:
            _, off, length = pl.item(LONG_VALUE)
            data = make(length)
            assert len(data) == length, (len(data), length)
            return pl.plant(files={**pl.files, RANK_FILE: rank_bytes(off, data)})
        return build

    def value_doc(**change: Any) -> Callable[[int], bytes]:
        doc = {"schema": "ckptfs.value", "format_version": 2, "tree": "n", "tensors": []}
        doc.update(change)
        return lambda length: fit(doc, length)

    # -- the manifest ------------------------------------------------------------------------
    def with_path(path: str) -> Callable[[], int]:
        def build() -> int:
            entries = pl.entries(pl.files)
            entries.append(pl.entry(path, b"evil"))
            return pl.plant(entries=entries)
        return build

    for path in ["/etc/passwd", "../../secret.bin", "rank-00000/../../secret.bin", "..",
                 "MANIFEST.json", "COMPLETE", "a//b", "s3://other-bucket/key", "%2e%2e/x",
                 "rank-00000\\..\\x", ""]:
        add(f"manifest path {path[:40]!r}", with_path(path), "unsafe")

    def entry_edit(target: str = RANK_FILE, **change: Any) -> Callable[[], int]:
        def build() -> int:
            entries = pl.entries(pl.files)
            for e in entries:
                if e["path"] == target:
                    e.update(change)
            return pl.plant(entries=entries)
        return build

    def declared(target: str, size: int) -> Callable[[], int]:
        """The file declared ``size`` B, its last chunk stretched so the chunks still tile it
        and the chunk list still matches the file digest: only the listing can refuse it."""
        def build() -> int:
            entries = pl.entries(pl.files)
            for e in entries:
                if e["path"] == target:
                    last = e["chunks"][-1]
                    last[1] += size - e["size"]
                    e["size"] = size
                    chunks = [Chunk(*c) for c in e["chunks"]]
                    e["digest"] = chunk_list_digest(pl.algorithm, chunks)
            return pl.plant(entries=entries)
        return build

    add("a rank file declared 2^45 B (its last chunk too)", declared(RANK_FILE, 1 << 45))
    add("dcp.msgpack declared 1 PiB", declared(METADATA_NAME, 1 << 50))
    for size in [-1, True, 1.5, "12", None]:
        add(f"declared size {size!r} of the rank file", entry_edit(size=size))
    add("chunks that do not tile the file",
        entry_edit(chunks=[[0, 8, "00" * 32], [4, 4, "00" * 32]]))
    add("a chunk of negative length", entry_edit(chunks=[[0, -1, "00" * 32]]))
    add("file digest not that of its chunk list", entry_edit(digest="sha256:" + "0" * 64))
    add("digest with an unknown algorithm", entry_edit(digest="md5:00", algorithm="md5"))
    add("negative rank", entry_edit(rank=-1))
    add("duplicate file entries",
        lambda: pl.plant(entries=pl.entries(pl.files) + pl.entries(pl.files)))
    add("manifest without its layout", lambda: pl.plant(doc_edit=lambda d: d.pop("layout")))
    add("manifest format version from the future",
        lambda: pl.plant(doc_edit=lambda d: d.update(format_version=99)), "version")
    add("world_size is not an int", lambda: pl.plant(doc_edit=lambda d: d.update(world_size="2")))
    add("manifest lists no dcp.msgpack",
        lambda: pl.plant(files={RANK_FILE: pl.files[RANK_FILE]}))

    # -- dcp.msgpack ---------------------------------------------------------------------------
    def evil() -> bytes:
        return pickle.dumps(Evil(sentinel))

    def evil_zip() -> bytes:
        import io

        buf = io.BytesIO()
        torch.save({"x": Evil(sentinel)}, buf)
        return buf.getvalue()

    add("dcp.msgpack is a pickle", with_dcp_bytes(evil))
    add("dcp.msgpack is a torch.save zip (pickle inside)", with_dcp_bytes(evil_zip))
    add("dcp.msgpack is not msgpack", with_dcp_bytes(lambda: b"\xc1" * 16))
    add("dcp.msgpack nested 100000 deep", with_dcp_bytes(lambda: b"\x91" * 100_000 + b"\xc0"))
    add("dcp.msgpack array header claiming 2^32-1 items",
        with_dcp_bytes(lambda: b"\xdd\xff\xff\xff\xff" + b"\xc0" * 8))
    add("dcp.msgpack with an ext type", with_dcp_bytes(
        lambda: packb({**pl.dcp, "extra": msgpack.ExtType(5, b"\x00")})), "unsafe")
    add("dcp.msgpack format version from the future",
        with_dcp(lambda d: d.update(format_version=3)), "version")
    add("dcp.msgpack of another schema", with_dcp(lambda d: d.update(schema="evil")))
    add("dcp.msgpack trailing garbage",
        with_dcp_bytes(lambda: pl.files[METADATA_NAME] + b"\x00"))

    def storage_edit(fqn: str, **change: Any) -> Callable[[dict[str, Any]], None]:
        def edit(d: dict[str, Any]) -> None:
            for row in d["storage_data"]:
                if row[0] == fqn:
                    for k, v in change.items():
                        row[{"path": 2, "offset": 3, "length": 4}[k]] = v
        return edit

    add("an item outside every chunk", with_dcp(storage_edit("model.w", offset=721)))
    add("an item longer than its chunk", with_dcp(storage_edit("model.w", length=65)))
    add("an item in a file not in the manifest",
        with_dcp(storage_edit("model.w", path="rank-00001/data-0.safetensors")))
    add("an item at '../secret.safetensors'",
        with_dcp(storage_edit("model.w", path="../secret.safetensors")), "unsafe")
    add("an item at an absolute path",
        with_dcp(storage_edit("model.w", path="/etc/passwd")), "unsafe")

    def sdm_edit(fqn: str, **change: Any) -> Callable[[dict[str, Any]], None]:
        return lambda d: d["state_dict_metadata"][fqn].update(change)

    add("tensor dtype naming a torch function", with_dcp(sdm_edit("model.w", dtype="load")))
    add("tensor dtype naming a dunder", with_dcp(sdm_edit("model.w", dtype="__class__")))
    add("a 4 GiB tensor with no chunks",
        with_dcp(sdm_edit("model.w", size=[1 << 16, 1 << 14], chunks=[])))
    add("chunks that leave a gap in a tensor",
        with_dcp(sdm_edit("model.w", chunks=[[[0, 0], [2, 4]]])))
    add("overlapping chunks of a tensor",
        with_dcp(sdm_edit("model.w", chunks=[[[0, 0], [4, 4]], [[0, 0], [4, 4]]])))
    add("a tensor chunk outside the tensor",
        with_dcp(sdm_edit("model.w", chunks=[[[2, 0], [4, 4]]])))

    def dup_sdm() -> bytes:
        # {"state_dict_metadata": {..., "model.w": <model.b's entry>}}: the key twice
        good = packb(pl.dcp)
        sdm = pl.dcp["state_dict_metadata"]
        head = packb(sdm)
        dup = bytes([head[0] + 1]) + head[1:] + packb("model.w") + packb(sdm["model.b"])
        return good.replace(head, dup, 1)

    add("a key twice in dcp.msgpack", with_dcp_bytes(dup_sdm))

    def tree_edit(tree: Any) -> Callable[[dict[str, Any]], None]:
        return lambda d: d.update(tree=tree)

    deep: Any = ["v", None]
    for _ in range(300):
        deep = ["l", [deep]]
    add("stored tree nested 300 deep", with_dcp(tree_edit(["d", [["model", deep]]])))
    add("stored tree with an unknown tag", with_dcp(tree_edit(["d", [["model", ["x!", []]]]])))
    add("stored tree root is a list", with_dcp(tree_edit(["l", []])))
    add("stored tree key naming a torch function",
        with_dcp(tree_edit(["d", [[["dt", "load"], ["v", None]]]])))

    # -- the rank file: its header chunk (digest valid) -----------------------------------------
    def header_with(**entry: Any) -> Callable[[], tuple[int, bytes]]:
        def make() -> tuple[int, bytes]:
            blob = pl.files[RANK_FILE]
            (hlen,) = struct.unpack("<Q", blob[:8])
            h = json.loads(blob[8:8 + hlen])
            name = next(k for k in h if k.startswith("model.w@"))
            h[name].update(entry)
            text = json.dumps(h, separators=(",", ":")).encode()
            text += b" " * (hlen - len(text))
            assert len(text) == hlen, "the edited header must keep its length"
            return 0, struct.pack("<Q", hlen) + text
        return make

    add("safetensors header length 2^60",
        with_rank_bytes(lambda: (0, struct.pack("<Q", 1 << 60))))
    add("safetensors header dtype differs from dcp.msgpack",
        with_rank_bytes(header_with(dtype="I32")))
    add("safetensors header shape differs from dcp.msgpack",
        with_rank_bytes(header_with(shape=[16])))
    add("safetensors header not JSON", with_rank_bytes(lambda: (8, b"\xff" * 8)))

    # -- a value document (digest valid) --------------------------------------------------------
    add("value document is a pickle",
        with_value(lambda n: evil() + b"\x00" * (n - len(evil()))))
    add("value document format version from the future",
        with_value(value_doc(format_version=99)), "version")
    add("value document of another schema", with_value(value_doc(schema="ckptfs.evil")))
    add("value document with an ext type",
        with_value(value_doc(tree=msgpack.ExtType(5, b"\x00"))), "unsafe")
    add("value document tree nested 300 deep", with_value(value_doc(tree=deep)))
    add("value document with an unknown tag", with_value(value_doc(tree=["pickle", "os"])))
    add("value document dtype tag naming a torch function",
        with_value(value_doc(tree=["dt", "load"])))
    add("value document tensor of the wrong byte length",
        with_value(value_doc(tree=["T", 0], tensors=[["F32", [4], b"\x00" * 3]])))
    add("value document tensor reference out of range", with_value(value_doc(tree=["T", 5])))
    if local:
        add("rank file is a symlink to a file outside the root", lambda: plant_symlinked(
            pl, RANK_FILE, sentinel + ".secret"), "unsafe")
        add("dcp.msgpack is a symlink to a file outside the root", lambda: plant_symlinked(
            pl, METADATA_NAME, sentinel + ".secret2"), "unsafe")
        add("attempt directory is a symlink", lambda: plant_symlinked(pl, None, None), "unsafe")
    return cases


def hostile_v2_names(*, local: bool) -> list[tuple[str, str]]:
    """(name, expected) of every case of `hostile_v2_cases`, without planting any."""
    return [(name, expected) for name, _, expected in
            hostile_v2_cases(cast(PlanterV2, None), "", local=local)]
