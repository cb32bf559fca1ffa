"""docs/protocol.md is normative: its by-hand checker (plain json/msgpack/hashlib/safetensors,
no ckptfs) must accept what ckptfs writes and reject what ckptfs would reject."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

import ckptfs
from ckptfs.errors import CorruptCheckpointError
from ckptfs.format.layout import StepPaths

SPEC = Path(__file__).resolve().parents[2] / "docs" / "protocol.md"


def checker_source() -> str:
    text = SPEC.read_text()
    m = re.search(r"<!-- by-hand-checker -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/protocol.md lost its by-hand checker"
    return m.group(1)


def run_checker(tmp_path: Path, root: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "check_by_hand.py"
    script.write_text(checker_source())
    return subprocess.run([sys.executable, str(script), str(root)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("algorithm", ["sha256", "blake3", "xxh3-128", "crc32c"])
def test_by_hand_checker_accepts_ckptfs_output(tmp_path: Path, algorithm: str) -> None:
    root = tmp_path / "run"
    store = ckptfs.open(str(root), algorithm=algorithm)
    model = torch.nn.Linear(3, 2)
    store.save(10, {"model": model.state_dict(), "trainer": {"step": 10}})
    store.save(20, {"model": model.state_dict(), "b": torch.ones(2, dtype=torch.bfloat16),
                    "trainer": {"step": 20, 0: (1, 2)}})
    # An incomplete newer attempt is skipped by the checker as by ckptfs.
    (root / "checkpoints" / "step-000000000030" / "a-20260101T000000Z-0000000000000000").mkdir(
        parents=True)
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert "step 20: committed, 2 files verified, 3 tensors" in done.stdout


def test_by_hand_checker_rejects_tampering(tmp_path: Path) -> None:
    root = tmp_path / "run"
    info = ckptfs.open(str(root)).save(5, {"w": torch.arange(10.0)})
    path = root / StepPaths(5).file(info.attempt, "tensors-00000.safetensors")
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and "tensors-00000.safetensors" in done.stderr


def test_marker_fields_match_spec(tmp_path: Path) -> None:
    info = ckptfs.open(str(tmp_path)).save(7, {"x": torch.zeros(1)})
    marker = json.loads((tmp_path / StepPaths(7).marker).read_bytes())
    assert set(marker) == {"schema", "format_version", "step", "attempt", "manifest",
                           "manifest_digest", "manifest_size", "created", "writer"}
    assert marker["attempt"] == info.attempt and marker["step"] == 7
    assert marker["manifest_digest"].startswith("sha256:")  # whatever the files use
    manifest = json.loads((tmp_path / StepPaths(7).manifest(info.attempt)).read_bytes())
    assert set(manifest) == {"schema", "format_version", "step", "attempt", "created",
                             "hash_algorithm", "files", "metadata"}
    assert all(set(f) == {"path", "size", "digest", "algorithm"} for f in manifest["files"])


# -- the checker is as strict as the spec, and agrees with ckptfs ------------------------------

def _reseal(root: Path, step: int, attempt: str) -> None:
    """Recompute every digest after a test edited a file, so only the edit itself is wrong."""
    adir = root / StepPaths(step).attempt_dir(attempt)
    mpath = adir / "MANIFEST.json"
    manifest = json.loads(mpath.read_bytes())
    for f in manifest["files"]:
        data = (adir / f["path"]).read_bytes()
        f["size"], f["digest"] = len(data), "sha256:" + hashlib.sha256(data).hexdigest()
    mbytes = json.dumps(manifest).encode()
    mpath.write_bytes(mbytes)
    marker_path = root / StepPaths(step).marker
    marker = json.loads(marker_path.read_bytes())
    marker["manifest_digest"] = "sha256:" + hashlib.sha256(mbytes).hexdigest()
    marker["manifest_size"] = len(mbytes)
    marker_path.write_bytes(json.dumps(marker).encode())


def _edit_state(adir: Path, edit: Any) -> None:
    doc = msgpack.unpackb((adir / "state.msgpack").read_bytes(), raw=False,
                          strict_map_key=False)
    edit(doc)
    (adir / "state.msgpack").write_bytes(msgpack.packb(doc, use_bin_type=True))


def _trailing_byte(adir: Path) -> None:
    with open(adir / "tensors-00000.safetensors", "ab") as f:
        f.write(b"\0")


def _header_too_long(adir: Path) -> None:
    p = adir / "tensors-00000.safetensors"
    data = p.read_bytes()
    p.write_bytes(struct.pack("<Q", len(data)) + data[8:])


def _bad_path(adir: Path) -> None:
    (adir / "a b").write_bytes(b"x")
    m = json.loads((adir / "MANIFEST.json").read_bytes())
    m["files"].append({"path": "a b", "size": 1, "digest": "sha256:00", "algorithm": "sha256"})
    (adir / "MANIFEST.json").write_bytes(json.dumps(m).encode())


def _noncanonical_bigint(adir: Path) -> None:
    _edit_state(adir, lambda d: d["tree"][1].append(["v", ["i", "+5"]]))


def _deep_tree(adir: Path) -> None:
    deep: Any = 0
    for _ in range(257):
        deep = ["l", [deep]]
    _edit_state(adir, lambda d: d["tree"][1].append(["deep", deep]))


def _newer_state(adir: Path) -> None:
    _edit_state(adir, lambda d: d.update(format_version=2))


@pytest.mark.parametrize("tamper", [_trailing_byte, _header_too_long, _bad_path,
                                    _noncanonical_bigint, _deep_tree, _newer_state])
def test_checker_and_ckptfs_reject_the_same_violations(tmp_path: Path, tamper: Any) -> None:
    root = tmp_path / "run"
    store = ckptfs.open(str(root), algorithm="sha256")
    info = store.save(1, {"w": torch.arange(6.0), "b": torch.ones(2, dtype=torch.int8)})
    tamper(root / StepPaths(1).attempt_dir(info.attempt))
    _reseal(root, 1, info.attempt)
    done = run_checker(tmp_path, root)
    assert done.returncode != 0, done.stdout
    with pytest.raises(CorruptCheckpointError):
        ckptfs.open(str(root)).load(1)


@pytest.mark.parametrize("tamper", [
    lambda m: m.update(attempt=m["attempt"] + "\n"),
    lambda m: m.update(manifest="OTHER.json"),
    lambda m: m.pop("writer"),
    lambda m: m.update(manifest_size=True),
])
def test_checker_and_ckptfs_reject_bad_markers(tmp_path: Path, tamper: Any) -> None:
    root = tmp_path / "run"
    ckptfs.open(str(root)).save(1, {"w": torch.zeros(1)})
    path = root / StepPaths(1).marker
    marker = json.loads(path.read_bytes())
    tamper(marker)
    path.write_bytes(json.dumps(marker).encode())
    assert run_checker(tmp_path, root).returncode != 0
    with pytest.raises(CorruptCheckpointError):
        ckptfs.open(str(root)).load(1)


def test_checker_and_ckptfs_reject_duplicate_keys(tmp_path: Path) -> None:
    root = tmp_path / "run"
    ckptfs.open(str(root)).save(1, {"w": torch.zeros(1)})
    path = root / StepPaths(1).marker
    text = path.read_text().rstrip()
    path.write_text(text[:-1] + ', "step": 1}')
    assert "duplicate" in run_checker(tmp_path, root).stderr
    with pytest.raises(CorruptCheckpointError, match="duplicate"):
        ckptfs.open(str(root)).load(1)


def test_checker_accepts_every_value_kind(tmp_path: Path) -> None:
    root = tmp_path / "run"
    z = torch.complex(torch.arange(3.0), torch.ones(3))
    ckptfs.open(str(root)).save(3, {
        "keys": {torch.Size([2, 3]): 1, (1, ("a", b"b")): 2, 2**70: 3, None: 4, 1.5: 5},
        "big": [-(10**4300 - 1), 2**64], "dtype": torch.float16, "empty": torch.empty(0, 3),
        "__metadata__": torch.ones(1), "z": z, "zc": z.conj(), "zi": z.conj().imag,
    }, metadata={"nested": {"a": [1, (2, 3)]}})
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert "step 3: committed, 2 files verified, 5 tensors" in done.stdout


def _sharded_run(root: Path) -> ckptfs.CheckpointInfo:
    """A format v2 checkpoint (one process: DCP without collectives), every value type."""
    from dist_util import save_sharded

    store = ckptfs.open(str(root))
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "b": torch.ones(2, dtype=torch.bfloat16),
             "empty": torch.zeros(0, 3), "scalar": torch.tensor(1.5),
             "trainer": {"step": 20, 0: (1, 2), "pair": (torch.ones(1), torch.zeros(2)),
                         "blob": b"\x80\x02", "big": 2**70, "dt": torch.float16}}
    store.save(10, {"model": model.state_dict()})          # v1 before it: both readable
    return save_sharded(store.storage, 20, state)


@pytest.mark.sharded
def test_by_hand_checker_accepts_sharded_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "run"
    info = _sharded_run(root)
    assert info.manifest.format_version == 2
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert "step 20: committed, sharded by 1 ranks, 2 files verified" in done.stdout


@pytest.mark.sharded
def test_by_hand_checker_rejects_sharded_tampering(tmp_path: Path) -> None:
    root = tmp_path / "run"
    info = _sharded_run(root)
    path = root / StepPaths(20).file(info.attempt, "rank-00000/data-0.safetensors")
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and "rank-00000/data-0.safetensors: chunk at" in done.stderr
    with pytest.raises(ckptfs.CorruptCheckpointError, match="rank-00000/data-0"):
        ckptfs.open(str(root)).load(20)


@pytest.mark.sharded
def test_by_hand_checker_accepts_several_rank_files_per_rank(tmp_path: Path) -> None:
    """A collective async save streamed through a staging budget writes one rank file per
    staged group (§8.3: ``rank-R/data-K``): the checker verifies every one; a flipped byte in
    one of the later files is refused by both."""
    root = tmp_path / "run"
    store = ckptfs.open(str(root), layout="ranks")
    g = torch.Generator().manual_seed(0)
    state = {"model": {f"w{i}": torch.randn(32, 64, generator=g) for i in range(8)},
             "trainer": {"step": 4}}
    info = store.save_async(4, state, staging_bytes=24 * 1024).result(timeout=60)
    rank_files = [f.path for f in info.manifest.files if f.path.startswith("rank-")]
    assert len(rank_files) >= 4 and "rank-00000/data-3.safetensors" in rank_files
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert f"step 4: committed, sharded by 1 ranks, {len(rank_files) + 1} files verified" \
        in done.stdout
    path = root / StepPaths(4).file(info.attempt, "rank-00000/data-3.safetensors")
    data = bytearray(path.read_bytes())
    data[-20] ^= 1
    path.write_bytes(bytes(data))
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and "rank-00000/data-3.safetensors: chunk at" in done.stderr
    with pytest.raises(ckptfs.CorruptCheckpointError, match="rank-00000/data-3"):
        store.load(4)


# -- format v2: the spec's tables and the checker's rules are the code's ------------------------

def _checker_namespace() -> dict[str, Any]:
    ns: dict[str, Any] = {}
    exec(checker_source().replace("check(sys.argv[1])", ""), ns)  # its functions, not a run
    return ns


def test_v2_dtype_table_matches_code() -> None:
    from ckptfs.format.sharded import element_size
    from ckptfs.format.sharded_metadata import DTYPE_NAMES

    text = SPEC.read_text()
    table = text[text.index("**Dtypes.**"):text.index("**Chunks of a tensor.**")]
    found: dict[str, tuple[str, int]] = {}
    for row in table.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) != 6 or not cells[0].startswith("`"):
            continue
        for names, codes, size in (cells[0:3], cells[3:6]):
            for name, code in zip(re.findall(r"`(\w+)`", names), re.findall(r"`(\w+)`", codes),
                                  strict=True):
                found[name] = (code, int(size))
    assert {n: c for n, (c, _) in found.items()} == DTYPE_NAMES
    assert all(element_size(c) == size for c, size in found.values())
    ns = _checker_namespace()
    assert ns["TORCH_DTYPES"] == DTYPE_NAMES
    assert all(ns["ITEMSIZE"][c] == size for c, size in found.values())


@pytest.mark.parametrize("size,chunks", [
    ([6], [([0], [6])]), ([9], [([0], [3]), ([3], [3]), ([6], [3]), ([9], [0])]),
    ([4, 4], [([0, 0], [2, 2]), ([0, 2], [2, 2]), ([2, 0], [2, 2]), ([2, 2], [2, 2])]),
    ([], [([], [])]), ([0], []), ([6], [([0], [3]), ([4], [2])]), ([6], [([0], [3]), ([2], [3])]),
    ([4, 4], [([0, 0], [4, 2]), ([0, 0], [2, 4]), ([2, 2], [2, 2])]), ([], [([], []), ([], [])]),
    ([6], [([0], [6]), ([2], [7])]), ([2**30], []), ([6], [([0, 0], [6, 1])]),
])
def test_checker_and_ckptfs_agree_on_chunk_cover(size: list[int], chunks: list[Any]) -> None:
    from ckptfs.format.sharded_metadata import check_cover

    lists = [[list(o), list(s)] for o, s in chunks]
    try:
        check_cover("t", size, chunks, "here")
        ours = True
    except CorruptCheckpointError:
        ours = False
    try:
        _checker_namespace()["check_cover"]("t", size, lists)
        theirs = True
    except AssertionError:
        theirs = False
    assert ours == theirs


# -- format v3 (incremental, §9) ---------------------------------------------------------------

def _incremental_run(root: Path, algorithm: str = "sha256") -> ckptfs.CheckpointStore:
    store = ckptfs.open(str(root), algorithm=algorithm, incremental=True)
    torch.manual_seed(0)
    frozen = {"w": torch.randn(16, 8), "b": torch.zeros(3, dtype=torch.bfloat16),
              "e": torch.empty(0, 4)}
    for step in (10, 20):
        store.save(step, {"base": frozen, "head": torch.full((4,), float(step)),
                          "trainer": {"step": step}})
    return store


@pytest.mark.parametrize("algorithm", ["sha256", "blake3"])
def test_by_hand_checker_accepts_incremental_checkpoint(tmp_path: Path, algorithm: str) -> None:
    root = tmp_path / "run"
    store = _incremental_run(root, algorithm)
    manifest = json.loads((root / StepPaths(20).manifest(store.info(20).attempt)).read_bytes())
    assert manifest["format_version"] == 3 and len(manifest["references"]) == 1
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert "step 20: committed, 2 files verified, 4 tensors, 1 references verified" \
        in done.stdout


def _tamper_reference(root: Path, store: Any, where: str) -> str:
    m = json.loads((root / StepPaths(20).manifest(store.info(20).attempt)).read_bytes())
    ref = m["references"][0]
    path = root / StepPaths(ref["step"]).file(ref["attempt"], ref["source"])
    if where == "missing":
        path.unlink()
        return "missing"
    if where == "size":
        with open(path, "ab") as f:
            f.write(b"\0")
        return "size"
    offset, length, _ = ref["chunks"][0 if where == "header" else -1]
    data = bytearray(path.read_bytes())
    data[offset + length - 1] ^= 1
    path.write_bytes(bytes(data))
    return "differ"


@pytest.mark.parametrize("where", ["tensor", "header", "missing", "size"])
def test_checker_and_ckptfs_reject_bad_references(tmp_path: Path, where: str) -> None:
    root = tmp_path / "run"
    store = _incremental_run(root)
    word = _tamper_reference(root, store, where)
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and word in done.stderr, done.stderr
    with pytest.raises(CorruptCheckpointError):
        ckptfs.open(str(root)).load(20)


# -- format v4 (sharded incremental, §9.6) -----------------------------------------------------

def _sharded_incremental_run(root: Path) -> ckptfs.CheckpointStore:
    """A format v4 run in one process (DCP without collectives): step 20 references the frozen
    tensors of step 10's rank file."""
    from dist_util import save_sharded

    from ckptfs.protocol.incremental import ReuseMemory

    store = ckptfs.open(str(root), incremental=True)
    memory = ReuseMemory()
    frozen = {"w": torch.arange(24.0).reshape(6, 4), "b": torch.ones(3, dtype=torch.bfloat16)}
    for step in (10, 20):
        save_sharded(store.storage, step, {"base": frozen, "head": torch.full((4,), float(step)),
                                           "trainer": {"step": step}},
                     algorithm="sha256", memory=memory)
    return store


@pytest.mark.sharded
def test_by_hand_checker_accepts_sharded_incremental_checkpoint(tmp_path: Path) -> None:
    root = tmp_path / "run"
    store = _sharded_incremental_run(root)
    manifest = json.loads((root / StepPaths(20).manifest(store.info(20).attempt)).read_bytes())
    assert manifest["format_version"] == 4 and len(manifest["references"]) == 1
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert "step 20: committed, sharded by 1 ranks, 2 files verified, 4 stored items, " \
        "1 references verified" in done.stdout


def _rechunk_reference(root: Path, store: Any, where: str) -> str:
    """Edit the chunk list of step 20's reference (its manifest and marker resealed, so only
    the edit is wrong): one of its item chunks dropped, or a chunk of the source file that
    dcp.msgpack places nowhere added."""
    attempt = store.info(20).attempt
    manifest = json.loads((root / StepPaths(20).manifest(attempt)).read_bytes())
    ref = manifest["references"][0]
    if where == "dropped":
        ref["chunks"].pop()
        word = "not a chunk of"
    else:
        source = json.loads((root / StepPaths(ref["step"]).manifest(ref["attempt"])).read_bytes())
        entry = next(f for f in source["files"] if f["path"] == ref["source"])
        used = {c[0] for c in ref["chunks"]}
        ref["chunks"] = sorted(ref["chunks"] + [next(c for c in entry["chunks"]
                                                     if c[0] not in used and c[1] > 0)])
        word = "not its header and its items"
    mbytes = json.dumps(manifest).encode()
    (root / StepPaths(20).manifest(attempt)).write_bytes(mbytes)
    marker_path = root / StepPaths(20).marker
    marker = json.loads(marker_path.read_bytes())
    marker["manifest_digest"] = "sha256:" + hashlib.sha256(mbytes).hexdigest()
    marker["manifest_size"] = len(mbytes)
    marker_path.write_bytes(json.dumps(marker).encode())
    return word


@pytest.mark.sharded
@pytest.mark.parametrize("where", ["tensor", "header", "missing", "size", "dropped", "extra"])
def test_checker_and_ckptfs_reject_bad_v4_references(tmp_path: Path, where: str) -> None:
    root = tmp_path / "run"
    store = _sharded_incremental_run(root)
    if where in ("dropped", "extra"):
        word = _rechunk_reference(root, store, where)
    else:
        word = _tamper_reference(root, store, where)
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and word in done.stderr, done.stderr
    with pytest.raises(CorruptCheckpointError):
        ckptfs.open(str(root)).load(20)


# -- format v5 (per-rank metadata, §9.7) -------------------------------------------------------

GOLDEN_V5 = Path(__file__).resolve().parents[1] / "golden" / "v5" / "run"


def _per_rank_run(root: Path, algorithm: str) -> ckptfs.CheckpointInfo:
    """A format v5 checkpoint saved on one rank (the collective save without a process group,
    ``metadata_layout="per-rank"``), every value type."""
    from ckptfs.testing.reliability.paths import save_v2

    store = ckptfs.open(str(root), algorithm=algorithm)
    model = torch.nn.Linear(3, 2)
    state = {"model": model.state_dict(), "b": torch.ones(2, dtype=torch.bfloat16),
             "empty": torch.zeros(0, 3), "scalar": torch.tensor(1.5),
             "trainer": {"step": 20, 0: (1, 2), "pair": (torch.ones(1), torch.zeros(2)),
                         "blob": b"\x80\x02", "big": 2**70, "dt": torch.float16}}
    store.save(10, {"model": model.state_dict()})          # v1 before it: both readable
    return save_v2(store, 20, state, metadata={"notes": "v5"}, metadata_layout="per-rank")


@pytest.mark.sharded
@pytest.mark.parametrize("algorithm", ["sha256", "crc32c"])
def test_by_hand_checker_accepts_per_rank_checkpoint(tmp_path: Path, algorithm: str) -> None:
    from ckptfs.format.versions import has_rank_metadata

    root = tmp_path / "run"
    info = _per_rank_run(root, algorithm)
    assert has_rank_metadata(info.manifest)
    done = run_checker(tmp_path, root)
    assert done.returncode == 0, done.stderr
    assert "step 20: committed, sharded by 1 ranks, per-rank metadata, 2 files and 1 rank " \
        "files verified, 12 stored items" in done.stdout, done.stdout


def _v5_two_ranks(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the golden v5 run holding its step 1 alone (written by 2 gloo ranks, blake3):
    the run root and the attempt directory."""
    root = tmp_path / "run"
    shutil.copytree(GOLDEN_V5, root)
    shutil.rmtree(root / "checkpoints" / "step-000000000002")
    step = root / "checkpoints" / "step-000000000001"
    return root, next(p for p in step.iterdir() if p.is_dir())


def _resign(adir: Path, path: str) -> None:
    """Bind the edited one-chunk file ``path`` of the v5 manifest again (its size, chunk and
    digest), and the manifest in the marker: only the edit itself is wrong."""
    from ckptfs.format.entries import Chunk, chunk_list_digest
    from ckptfs.format.hashing import digest_bytes

    mpath = adir / "MANIFEST.json"
    manifest = json.loads(mpath.read_bytes())
    entry = next(f for f in manifest["files"] if f["path"] == path)
    data = (adir / path).read_bytes()
    hexd = digest_bytes(entry["algorithm"], data).split(":", 1)[1]
    entry["size"], entry["chunks"] = len(data), [[0, len(data), hexd]]
    entry["digest"] = chunk_list_digest(entry["algorithm"], [Chunk(0, len(data), hexd)])
    mbytes = json.dumps(manifest).encode()
    mpath.write_bytes(mbytes)
    marker_path = adir.parent / "COMPLETE"
    marker = json.loads(marker_path.read_bytes())
    marker["manifest_digest"] = "sha256:" + hashlib.sha256(mbytes).hexdigest()
    marker["manifest_size"] = len(mbytes)
    marker_path.write_bytes(json.dumps(marker).encode())


BLOCK = "rank-table/block-00000.bin"
ROW = struct.Struct(">IBQQ")  # rank, flags, file size, index size; two raw digests follow


def _edit_rows(adir: Path, edit: Any) -> None:
    """Rewrite the rows of the table's one block (``edit(rows)``, each row ``[rank, flags,
    file size, index size, file digest, index digest]``) and bind the block again."""
    data = (adir / BLOCK).read_bytes()
    width = (len(data) // 2 - ROW.size) // 2
    rows = []
    for i in range(2):
        row = data[i * len(data) // 2:(i + 1) * len(data) // 2]
        rows.append([*ROW.unpack(row[:ROW.size]), row[ROW.size:ROW.size + width],
                     row[ROW.size + width:]])
    edit(rows)
    (adir / BLOCK).write_bytes(b"".join(ROW.pack(*r[:4]) + r[4] + r[5] for r in rows))
    _resign(adir, BLOCK)


def _v5_block_byte(adir: Path) -> str:
    data = bytearray((adir / BLOCK).read_bytes())
    data[30] ^= 1
    (adir / BLOCK).write_bytes(bytes(data))
    return f"{BLOCK}: chunk at 0"


def _v5_index_swapped(adir: Path) -> str:
    """Rank 1's index document in rank 0's place (and back), each row naming the size and
    digest of the document now in its place: the documents describe the other rank."""
    import blake3

    a, b = adir / "rank-00000" / "index.msgpack", adir / "rank-00001" / "index.msgpack"
    da, db = a.read_bytes(), b.read_bytes()
    a.write_bytes(db)
    b.write_bytes(da)

    def edit(rows: list[list[Any]]) -> None:
        for row, data in zip(rows, (db, da), strict=True):
            row[3], row[5] = len(data), blake3.blake3(data).digest()

    _edit_rows(adir, edit)
    return "rank-00000/index.msgpack: names rank 1: another rank's index"


def _v5_row_emptied(adir: Path) -> str:
    def edit(rows: list[list[Any]]) -> None:
        rows[1][1:] = [0, 0, 0, bytes(len(rows[1][4])), bytes(len(rows[1][5]))]

    _edit_rows(adir, edit)
    return "the spec places items in the file of rank 1, whose row has none"


def _v5_spec_changed(adir: Path) -> str:
    """The spec places a value in rank 1's file; rank 0's holds it."""
    path = adir / "dcp-spec.msgpack"
    spec = msgpack.unpackb(path.read_bytes(), raw=False)
    assert spec["values"]["trainer.step"] == 0
    spec["values"]["trainer.step"] = 1
    path.write_bytes(msgpack.packb(spec, use_bin_type=True))
    _resign(adir, "dcp-spec.msgpack")
    return "the spec places 'trainer.step' at None (U8 None) in the file of rank 1, whose " \
        "index does not hold it so"


def _v5_spec_overlap(adir: Path) -> str:
    """The spec lists an empty chunk of rank 0 at the offsets of the grid's cell of rank 1:
    two chunks of one name and offsets, each its rank's, which a full read would mix up."""
    path = adir / "dcp-spec.msgpack"
    spec = msgpack.unpackb(path.read_bytes(), raw=False)
    t = spec["tensors"]["rows.float32"]
    assert (t["grid"], t["owners"], t["empty"]) == ([4, 3], [0, 1], [])
    t["empty"] = [[[4, 0], [0, 3], 0]]
    path.write_bytes(msgpack.packb(spec, use_bin_type=True))
    _resign(adir, "dcp-spec.msgpack")
    return "tensor rows.float32: an empty chunk (rank 0) at the offsets [4, 0] of a cell (rank 1)"


def _v5_rank_file_missing(adir: Path) -> str:
    (adir / "rank-00001" / "data-0.safetensors").unlink()
    return "rank-00001/data-0.safetensors: missing"


def _v5_stray_file(adir: Path) -> str:
    (adir / "rank-00001" / "data-1.safetensors").write_bytes(b"x")
    return "stray files: ['rank-00001/data-1.safetensors']"


@pytest.mark.parametrize(("tamper", "ckptfs_says"), [
    (_v5_block_byte, "block-00000.bin"),
    (_v5_index_swapped, "another rank's index"),
    (_v5_row_emptied, "whose row in rank-table/block-00000.bin has none"),
    (_v5_spec_changed, "whose index does not hold it so"),
    (_v5_spec_overlap, "'rows.float32': its chunks must tile it exactly once"),
    (_v5_rank_file_missing, "rank-00001/data-0.safetensors: listed in the manifest but missing"),
    (_v5_stray_file, "rank-00001/data-1.safetensors: not in the manifest (stray file)"),
])
@pytest.mark.sharded
def test_checker_and_ckptfs_reject_v5_tampering(tmp_path: Path, tamper: Any,
                                                ckptfs_says: str) -> None:
    """Each edit of a 2-rank v5 checkpoint fails the checker for its own reason, and ckptfs
    refuses it too (a stray file: load ignores it, a full verify reports it)."""
    root, adir = _v5_two_ranks(tmp_path)
    assert run_checker(tmp_path, root).returncode == 0
    word = tamper(adir)
    done = run_checker(tmp_path, root)
    assert done.returncode != 0 and word in done.stderr, done.stderr
    store = ckptfs.open(str(root))
    if tamper is _v5_stray_file:
        store.load(1)
    with pytest.raises(CorruptCheckpointError, match=re.escape(ckptfs_says)):
        store.verify(1) if tamper is _v5_stray_file else store.load(1)


@pytest.mark.parametrize("layout", [
    {"size": [7, 3], "grid": [4, 3], "owners": [0, 1]},
    {"size": [6], "grid": [2], "owners": [0, 0]},
    {"size": [], "grid": [], "owners": [2, 0]},
    {"size": [9], "grid": [3], "owners": [1, 1], "empty": [[[9], [0], 0]]},
    {"size": [4, 4], "grid": [2, 2], "owners": [0, 1], "empty": [[[4, 0], [0, 4], 3]]},
    {"size": [9], "grid": [2], "owners": [0, 1]},                          # last owner 4
    {"size": [9], "grid": [3], "owners": [0, -1]},
    {"size": [9], "grid": [3], "owners": [0, 1], "empty": [[[9], [1], 0]]},  # not empty
    {"size": [9], "grid": [3], "owners": [0, 1], "empty": [[[9], [0], 0], [[9], [0], 1]]},
    {"size": [9], "grid": [3], "owners": [0, 1], "empty": [[[9], [0], 4]]},
    {"size": [0, 5], "grid": [1, 5], "owners": [0, 0]},                    # a dimension 0
    {"size": [6], "grid": [0], "owners": [0, 0]},
    {"size": [0, 5], "chunks": [[[0, 0], [0, 5], 1]]},
    {"size": [5], "chunks": [[[0], [3], 0], [[3], [2], 3]]},
    {"size": [5], "chunks": [[[0], [3], 0], [[2], [3], 1]]},                # overlap
    {"size": [5], "chunks": [[[0], [5], 4]]},                               # rank 4
    {"size": [5], "chunks": [[[0], [5], 0]], "grid": [5]},
    {"size": [5], "chunks": [[[0], [5], 0]], "empty": [[[5], [0], 1]]},
    # the chunks of a tensor tile it exactly once, whatever its layout
    {"size": [8, 5], "grid": [4, 5], "owners": [0, 1], "empty": [[[4, 0], [0, 5], 0]]},
    {"size": [8, 5], "grid": [4, 5], "owners": [0, 1], "empty": [[[0, 0], [0, 5], 0]]},
    {"size": [8, 5], "grid": [4, 5], "owners": [0, 1], "empty": [[[2, 0], [0, 5], 2]]},
    {"size": [8, 5], "grid": [4, 5], "owners": [0, 1], "empty": [[[0, 2], [4, 0], 2]]},
    {"size": [8, 5], "grid": [4, 5], "owners": [0, 1], "empty": [[[4, 2], [0, 3], 2]]},
    {"size": [8, 5], "grid": [4, 5], "owners": [0, 1], "empty": [[[8, 0], [0, 5], 2]]},
    {"size": [8, 6], "grid": [4, 3], "owners": [0, 1],
     "empty": [[[2, 3], [0, 3], 0], [[8, 0], [0, 6], 1]]},
    {"size": [8, 6], "grid": [4, 3], "owners": [0, 1],
     "empty": [[[8, 0], [0, 6], 1], [[5, 3], [2, 0], 2], [[2, 6], [3, 0], 3]]},
    {"size": [8, 6], "grid": [4, 3], "owners": [0, 1],                     # two empty ones
     "empty": [[[4, 1], [0, 3], 1], [[3, 3], [2, 0], 2]]},
    {"size": [5], "chunks": [[[0], [3], 0], [[1], [0], 1], [[3], [2], 1]]},
    {"size": [5], "chunks": [[[0], [3], 0], [[5], [0], 1], [[3], [2], 1]]},
    {"size": [5], "chunks": [[[0], [3], 0]]},                               # a gap
    {"size": [], "chunks": [[[], [], 1]]},
    {"size": [], "chunks": []},
])
def test_checker_and_ckptfs_agree_on_spec_layouts(layout: dict[str, Any]) -> None:
    """A tensor of dcp-spec.msgpack (§9.7, 4 ranks): the checker accepts exactly the layouts
    ckptfs's decoder accepts, and finds the same chunks and ranks."""
    from ckptfs.format.rank_metadata import decode_spec

    entry = {"dtype": "float32", "requires_grad": False, "memory_format": "contiguous_format",
             "pin_memory": False, "grid": None, "owners": None, "chunks": None, "empty": [],
             **layout}
    doc = {"schema": "ckptfs.dcp-spec", "format_version": 5, "world_size": 4, "version": None,
           "tensors": {"t": entry}, "values": {}, "planner_data": None, "storage_meta": None,
           "tree": None, "extra": {}}
    ours: list[Any] | None
    try:
        spec = decode_spec(msgpack.packb(doc, use_bin_type=True), 4, where="here")
        ours = sorted((list(c.offsets), list(c.sizes), c.rank) for c in spec.tensors["t"].cells())
    except CorruptCheckpointError:
        ours = None
    theirs: list[Any] | None
    try:
        theirs = sorted(_checker_namespace()["spec_chunks"]("t", entry, 4))
    except AssertionError:
        theirs = None
    assert ours == theirs
