"""Hostile and damaged format v5 checkpoints (per-rank metadata, docs/protocol.md §9.7), end to
end: a two-rank save (one gloo pair for the module), then each case damages a copy of it and
every reader refuses it with a typed error naming the file: ``load``, ``load(into=)`` (the
collective load on one process, which needs both ranks' files), full ``verify`` and ``ckptfs
cp`` (which commits nothing and leaves nothing at its destination); no reader writes anything
into the damaged run.

The v5 documents are what is new: a rank file missing (the table still names it), one rank's
index document in another's place (as storage mixed them up, and as an attacker would plant
it: the table row and the manifest re-signed so that every digest holds, so only the index's
own rank and file names can refuse it), a table block tampered (a flipped byte; re-signed: a
rank's row emptied while the spec places items in its file), and the tensor spec tampered (a
flipped byte; re-signed: another world size; re-signed: two ranks' chunks at the same
offsets), an index document that is a msgpack bomb, and sizes declared beyond the format's
limits (an index, a table block, the spec), each refused before a byte of what it declares is
requested.  The v5 cell of tests/paths.py runs the corruption matrix, the hardening, crash and
power-cut sweeps; the planted documents of the generic hostile sweep are v1-v3's, these are
v5's."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

import msgpack
import paths
import pytest
import torch
from dist_util import run_ranks

import ckptfs
from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptfs.format.entries import Chunk, make_entry
from ckptfs.format.hashing import digest_bytes
from ckptfs.format.layout import StepPaths
from ckptfs.format.limits import MAX_METADATA_BYTES, MAX_RANK_INDEX_BYTES
from ckptfs.format.rank_metadata import SPEC_NAME, RankRow, decode_block, encode_block

pytestmark = pytest.mark.sharded  # format v5: the sharded machinery (torch >= 2.9)

BLOCK = "rank-table/block-00000.bin"
INDEX0, INDEX1 = "rank-00000/index.msgpack", "rank-00001/index.msgpack"
FILE1 = "rank-00001/data-0.safetensors"


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.randn(7, generator=g),
            "step": 3, "opt": {"lr": 0.25}}


def job_save(rank: int, world: int, url: str) -> Any:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    full = _state()
    state = {"w": distribute_tensor(full["w"], mesh, [Shard(0)]), "b": full["b"],
             "step": full["step"], "opt": full["opt"]}
    return ckptfs.open(url, metadata_layout="per-rank").save(1, state).manifest.format_version


@pytest.fixture(scope="module")
def donor(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A two-rank v5 checkpoint (step 1): rank 0 and rank 1 each hold half of ``w``."""
    root = str(tmp_path_factory.mktemp("v5-donor") / "run")
    assert run_ranks(job_save, 2, root, timeout=240) == [5, 5]
    store = ckptfs.open(root)
    info = paths.every_file(store, store.info(1))
    assert {INDEX0, INDEX1, FILE1} <= {e.path for e in info.manifest.files}
    return root


class Run:
    """A copy of the donor's run root, damaged by one case."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.store = ckptfs.open(root, retries=0)
        self.info = self.store.info(1)
        self.dir = os.path.join(root, self.info.path)

    def path(self, rel: str) -> str:
        return os.path.join(self.dir, rel)

    def read(self, rel: str) -> bytes:
        with open(self.path(rel), "rb") as fh:
            return fh.read()

    def write(self, rel: str, data: bytes) -> None:
        with open(self.path(rel), "wb") as fh:
            fh.write(data)

    def flip(self, rel: str, pos: int | None = None) -> None:
        data = bytearray(self.read(rel))
        data[len(data) // 2 if pos is None else pos] ^= 0x01
        self.write(rel, bytes(data))

    def resign(self, edits: dict[str, bytes]) -> None:
        """Write ``edits`` (documents the manifest lists) and re-sign: their manifest entries
        hold the new bytes' digests, the marker the new manifest's, as an attacker who can write
        the bucket would plant them."""
        m = self.info.manifest
        algo = m.hash_algorithm
        files = []
        for e in m.files:
            if e.path in edits:
                data = edits[e.path]
                self.write(e.path, data)
                hexd = digest_bytes(algo, data).split(":", 1)[1]
                e = make_entry(e.path, len(data), algo, [Chunk(0, len(data), hexd)], None)
            files.append(e)
        self.resign_manifest(dataclasses.replace(m, files=tuple(files)))

    def resign_manifest(self, manifest: Any) -> None:
        """``manifest`` written in place of the attempt's, the marker re-signed to it."""
        mbytes = manifest.to_bytes()
        self.write("MANIFEST.json", mbytes)
        marker_path = os.path.join(self.root, StepPaths(1).marker)
        with open(marker_path) as fh:
            marker = json.load(fh)
        marker.update(manifest_digest=digest_bytes("sha256", mbytes), manifest_size=len(mbytes))
        with open(marker_path, "w") as fh:
            json.dump(marker, fh)

    def rows(self) -> list[RankRow]:
        algo = self.info.manifest.hash_algorithm
        return decode_block(self.read(BLOCK), algo, 0, 2, where=BLOCK)


def _swap_index_resigned(run: Run) -> None:
    run.write(INDEX0, run.read(INDEX1))
    rows = run.rows()
    rows[0] = dataclasses.replace(rows[0], index_size=rows[1].index_size,
                                  index_digest=rows[1].index_digest)
    run.resign({BLOCK: encode_block(rows, run.info.manifest.hash_algorithm)})


def _empty_row_resigned(run: Run) -> None:
    rows = run.rows()
    rows[1] = RankRow.empty(1, run.info.manifest.hash_algorithm)
    run.resign({BLOCK: encode_block(rows, run.info.manifest.hash_algorithm)})


def _spec_world_resigned(run: Run) -> None:
    spec = msgpack.unpackb(run.read(SPEC_NAME), raw=False, strict_map_key=False)
    spec["world_size"] = 3
    run.resign({SPEC_NAME: msgpack.packb(spec, use_bin_type=True)})


def _spec_overlap_resigned(run: Run) -> None:
    """An empty chunk of ``w`` placed on rank 0 at the offsets of rank 1's cell: each rank's
    index could hold its own, and a full read would find two chunks of one name and offsets
    (one in the other's place); the spec itself must be refused."""
    spec = msgpack.unpackb(run.read(SPEC_NAME), raw=False, strict_map_key=False)
    w = spec["tensors"]["w"]
    assert (w["grid"], w["owners"], w["empty"]) == ([4, 5], [0, 1], [])
    w["empty"] = [[[4, 0], [0, 5], 0]]
    run.resign({SPEC_NAME: msgpack.packb(spec, use_bin_type=True)})


def _index_bomb_resigned(run: Run) -> None:
    """Rank 1's index replaced by a msgpack array header declaring 2^31 elements (a few bytes
    that would ask for gigabytes), its row and the manifest re-signed: decoded without
    allocating what it declares, refused."""
    algo = run.info.manifest.hash_algorithm
    bomb = b"\xdd\x7f\xff\xff\xff" + b"\x00" * 16
    run.write(INDEX1, bomb)
    rows = run.rows()
    rows[1] = dataclasses.replace(rows[1], index_size=len(bomb),
                                  index_digest=digest_bytes(algo, bomb))
    run.resign({BLOCK: encode_block(rows, algo)})


def _index_declared_huge_resigned(run: Run) -> None:
    """Rank 1's row declares an index beyond the format's limit (re-signed): refused before
    a byte of it is requested."""
    rows = run.rows()
    rows[1] = dataclasses.replace(rows[1], index_size=MAX_RANK_INDEX_BYTES + 1)
    run.resign({BLOCK: encode_block(rows, run.info.manifest.hash_algorithm)})


def _declared_huge_resigned(rel: str, size: int) -> Callable[[Run], None]:
    """The manifest declares ``rel`` ``size`` bytes long (one chunk), re-signed."""
    def damage(run: Run) -> None:
        m = run.info.manifest
        algo = m.hash_algorithm
        hexd = digest_bytes(algo, run.read(rel)).split(":", 1)[1]
        files = tuple(make_entry(e.path, size, algo, [Chunk(0, size, hexd)], None)
                      if e.path == rel else e for e in m.files)
        run.resign_manifest(dataclasses.replace(m, files=files))
    return damage


#: name -> (damage, the file the error names, a phrase of it)
CASES: dict[str, tuple[Callable[[Run], None], str, str]] = {
    "rank file missing": (lambda r: os.remove(r.path(FILE1)), FILE1, "missing"),
    "index swapped with another rank's": (
        lambda r: r.write(INDEX0, r.read(INDEX1)), INDEX0, ""),
    "index swapped, table re-signed": (_swap_index_resigned, INDEX0, "another rank's index"),
    "table block byte flipped": (lambda r: r.flip(BLOCK), BLOCK, ""),
    "table row emptied, re-signed": (_empty_row_resigned, BLOCK, "has none"),
    "spec byte flipped": (lambda r: r.flip(SPEC_NAME), SPEC_NAME, ""),
    "spec world size, re-signed": (_spec_world_resigned, SPEC_NAME, "world"),
    "spec chunks overlapping across ranks, re-signed": (
        _spec_overlap_resigned, SPEC_NAME, "tensor 'w': its chunks must tile it exactly once"),
    "index a msgpack bomb, re-signed": (_index_bomb_resigned, INDEX1, ""),
    # sizes declared beyond the format's limits: refused where they are decoded, before a
    # byte of what they describe is requested
    "index declared beyond its limit, re-signed": (
        _index_declared_huge_resigned, BLOCK, "B index (at most"),
    "table block declared beyond its rows, re-signed": (
        _declared_huge_resigned(BLOCK, 1 << 40), BLOCK, "its rows"),
}

#: Sizes declared beyond the format's limits (re-signed): a reader refuses them before it asks
#: storage for a byte (`UnsafeCheckpointError` "exceeds"); a full verify may find the stored
#: size first.  name -> (damage, the file the error names)
DECLARED: dict[str, tuple[Callable[[Run], None], str]] = {
    "spec declared beyond its limit": (
        _declared_huge_resigned(SPEC_NAME, MAX_METADATA_BYTES + 1), SPEC_NAME),
}


def _into() -> dict[str, Any]:
    return {"w": torch.zeros(8, 5), "b": torch.zeros(7), "step": 0, "opt": {"lr": 0.0}}


def _listing(root: str) -> dict[str, bytes]:
    out = {}
    for base, _, names in os.walk(root):
        for n in names:
            with open(os.path.join(base, n), "rb") as fh:
                out[os.path.relpath(os.path.join(base, n), root)] = fh.read()
    return out


def test_the_donor_loads_bit_exact(donor: str) -> None:
    store = ckptfs.open(donor)
    got, want = store.load(1), _state()
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["b"], want["b"])
    into = _into()
    store.load(1, into=into)
    assert torch.equal(into["w"], want["w"]) and into["opt"] == {"lr": 0.25}
    assert store.verify(1).ok


@pytest.mark.parametrize("case", list(CASES))
def test_every_reader_refuses_a_damaged_v5_checkpoint(donor: str, case: str,
                                                      tmp_path: Any) -> None:
    damage, named, phrase = CASES[case]
    root = str(tmp_path / "run")
    shutil.copytree(donor, root)
    run = Run(root)
    damage(run)
    before = _listing(root)
    store = ckptfs.open(root, retries=0)
    reads: dict[str, Callable[[], Any]] = {
        "load": lambda: store.load(1),
        "load-into": lambda: store.load(1, into=_into()),
        "verify": lambda: store.verify(1),
        "cp": lambda: paths.read("cp", store, 1),
    }
    for how, fn in reads.items():
        with pytest.raises(CorruptCheckpointError) as err:
            fn()
        msg = str(err.value)
        assert named in msg and phrase in msg, (how, msg)
        assert "step-000000000001" in msg or "step 1" in msg, (how, msg)
    assert _listing(root) == before  # no reader wrote into the damaged run


def test_cp_copies_every_file_the_table_names(donor: str, tmp_path: Any) -> None:
    """``ckptfs cp`` of a two-rank v5 step (one process): every rank file and index document
    the table names is copied and checked, the manifest keeps its table, the copy loads
    bit-exact and verifies; copied again, it is "identical"."""
    from ckptfs.protocol.copy import copy_step

    src = ckptfs.open(donor)
    dst = ckptfs.open(str(tmp_path / "copy"))
    result = copy_step(src.storage, dst.storage, 1, threads=2)
    assert result.status == "copied"
    info = dst.info(1)
    assert info.manifest.format_version == 5
    assert info.manifest.rank_table == src.info(1).manifest.rank_table
    want = {e.path for e in paths.every_file(src, src.info(1)).manifest.files}
    assert {e.path for e in paths.every_file(dst, info).manifest.files} == want
    assert {INDEX0, INDEX1, FILE1} <= want
    assert dst.verify(1).ok
    got, state = dst.load(1), _state()
    assert torch.equal(got["w"], state["w"]) and torch.equal(got["b"], state["b"])
    assert copy_step(src.storage, dst.storage, 1).status == "identical"


@pytest.mark.parametrize("case", list(DECLARED))
def test_sizes_declared_beyond_the_limits_are_refused_before_reading(
        donor: str, case: str, tmp_path: Any) -> None:
    damage, named = DECLARED[case]
    root = str(tmp_path / "run")
    shutil.copytree(donor, root)
    run = Run(root)
    damage(run)
    before = _listing(root)
    store = ckptfs.open(root, retries=0)
    for how, fn in {"load": lambda: store.load(1),
                    "load-into": lambda: store.load(1, into=_into())}.items():
        with pytest.raises(UnsafeCheckpointError) as err:
            fn()
        assert named in str(err.value) and "exceeds" in str(err.value), (how, str(err.value))
    for how, fn in {"verify": lambda: store.verify(1),
                    "cp": lambda: paths.read("cp", store, 1)}.items():
        with pytest.raises(CorruptCheckpointError) as err:
            fn()
        assert named in str(err.value), (how, str(err.value))
    assert _listing(root) == before
