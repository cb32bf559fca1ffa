"""Format v5 whose files lie on the ranks' nodes (a two-tier store's per-node storage): the
index documents gathered over the group (`rank_metadata.expand_over`) and a node's own part
checked without the table (`rank_metadata.own_rank_files`).  In one process, a world of one
(the two-rank cases: tests/protocol/test_tiers_sharded.py): the gathered view is the one a
reader builds, and a hostile or damaged index (a link, a FIFO, a flipped byte, another rank's
index, a missing one) is refused with a typed error naming it, never read through or waited
on."""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptfs.protocol.group import WorldOfOne
from ckptfs.protocol.listing import list_attempt, problems
from ckptfs.protocol.rank_metadata import expand, expand_over, own_rank_files
from ckptfs.protocol.resolve import CheckpointInfo

pytestmark = pytest.mark.sharded


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(9, generator=g),
            "trainer": {"step": 4}}


def _saved(root: Path) -> tuple[Any, CheckpointInfo]:
    store = ckptfs.open(str(root), layout="ranks", metadata_layout="per-rank")
    info = store.save(1, _state())
    assert info.manifest.format_version == 5
    return store, info


def _index(root: Path) -> Path:
    return next(root.glob("checkpoints/step-*1/*/rank-00000/index.msgpack"))


def _files(view: CheckpointInfo) -> dict[str, tuple[int, str]]:
    return {e.path: (e.size, e.digest) for e in view.manifest.files}


def test_the_gathered_view_is_the_readers(tmp_path: Path) -> None:
    store, info = _saved(tmp_path / "run")
    view = expand_over(store.storage, info, WorldOfOne(), 0)
    assert _files(view) == _files(expand(store.storage, info))
    assert {"rank-00000/index.msgpack", "rank-00000/data-0.safetensors"} <= set(_files(view))
    assert expand_over(store.storage, view, WorldOfOne(), 0) is view  # expanded already


@pytest.mark.parametrize("how", ["link", "fifo", "directory"])
def test_an_index_that_is_not_a_regular_file_is_refused(tmp_path: Path, how: str) -> None:
    store, info = _saved(tmp_path / "run")
    index = _index(tmp_path / "run")
    kept = tmp_path / "kept.msgpack"
    shutil.move(index, kept)
    if how == "link":
        index.symlink_to(kept)
    elif how == "fifo":
        os.mkfifo(index)  # an open for reading would wait for a writer forever
    else:
        index.mkdir()
    with pytest.raises(UnsafeCheckpointError, match=r"index\.msgpack is not a regular file"):
        expand_over(store.storage, info, WorldOfOne(), 0)
    with pytest.raises(UnsafeCheckpointError, match="not a regular file"):
        own_rank_files(store.storage, info, 0)


def test_a_damaged_index_is_named(tmp_path: Path) -> None:
    store, info = _saved(tmp_path / "run")
    index = _index(tmp_path / "run")
    data = bytearray(index.read_bytes())
    data[len(data) // 2] ^= 0x01
    index.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"index\.msgpack: bytes 0\.\.") as exc:
        expand_over(store.storage, info, WorldOfOne(), 0)
    assert "differ from their digest" in str(exc.value)
    index.write_bytes(bytes(data) + b"x")  # one byte longer than its row says
    with pytest.raises(CorruptCheckpointError, match="the checkpoint declares"):
        expand_over(store.storage, info, WorldOfOne(), 0)


def test_another_ranks_index_is_refused_by_its_own_rules(tmp_path: Path) -> None:
    store, info = _saved(tmp_path / "run")
    with pytest.raises(CorruptCheckpointError, match="names rank 0, its row is rank 3"):
        attempt = _index(tmp_path / "run").parent.parent
        (attempt / "rank-00003").mkdir()
        shutil.copy(_index(tmp_path / "run"), attempt / "rank-00003" / "index.msgpack")
        own_rank_files(store.storage, info, 3)


def test_a_missing_index_is_on_no_node_unless_the_remote_copy_has_it(tmp_path: Path) -> None:
    from ckptfs.protocol.copy import copy_step

    store, info = _saved(tmp_path / "run")
    remote = ckptfs.open(str(tmp_path / "remote"))
    copy_step(store.storage, remote.storage, 1)
    there = remote.info(1)
    _index(tmp_path / "run").unlink()
    with pytest.raises(CorruptCheckpointError, match="on no rank's node"):
        expand_over(store.storage, info, WorldOfOne(), 0)
    view = expand_over(store.storage, info, WorldOfOne(), 0,
                       remote=(remote.storage, there))
    assert _files(view) == _files(expand(remote.storage, there))
    assert own_rank_files(store.storage, info, 0) == []  # nothing of this rank here


def test_a_nodes_own_part_is_listed_from_its_index(tmp_path: Path) -> None:
    store, info = _saved(tmp_path / "run")
    mine = own_rank_files(store.storage, info, 0)
    assert [e.path for e in mine] == ["rank-00000/index.msgpack", "rank-00000/data-0.safetensors"]
    full = _files(expand(store.storage, info))
    assert {e.path: (e.size, e.digest) for e in mine} == {e.path: full[e.path] for e in mine}
    data = next((tmp_path / "run").glob("checkpoints/step-*1/*/rank-00000/data-0.safetensors"))
    with data.open("ab") as f:
        f.write(b"\0")  # resized
    view = dataclasses.replace(info, manifest=dataclasses.replace(
        info.manifest, files=(*info.manifest.files, *mine)))
    found = problems(view, list_attempt(store.storage, view), files=mine)
    assert [p.kind for p in found] == ["size"], found
    with pytest.raises(CorruptCheckpointError, match="size differs"):
        ckptfs.open(str(tmp_path / "run")).verify(1, quick=True)


def test_an_index_on_another_ranks_node_is_found(tmp_path: Path) -> None:
    """A job started again with its ranks on other nodes: this process is rank 5 now, its node
    holds rank 0's files; the second round finds rank 0's index here."""
    store, info = _saved(tmp_path / "run")
    view = expand_over(store.storage, info, WorldOfOne(), 5)
    assert _files(view) == _files(expand(store.storage, info))
