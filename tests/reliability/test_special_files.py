"""A file of a checkpoint on local disk replaced by something that is not a regular file: a
FIFO (a read would wait for a writer forever), a directory, or a link to a FIFO.  Every reader
(``latest``, ``load``, ``verify`` quick and full, ``load(into=)``, ``ckptfs cp``) refuses it
with a typed error naming the file, within seconds, never waiting on it: the marker and
``MANIFEST.json`` of every format are read before any listing, and so are format v5's spec,
table blocks and index documents.  Before, a FIFO there hung every one of them."""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.errors import CkptfsError, CorruptCheckpointError

LAYOUTS = {"v1": {}, "v2": {"layout": "ranks", "metadata_layout": None},
           "v5": {"layout": "ranks", "metadata_layout": "per-rank"}}
#: The files read before the listing, per format (the others are refused by the listing).
FILES = [("v1", "COMPLETE"), ("v1", "MANIFEST.json"), ("v1", "state.msgpack"),
         ("v2", "MANIFEST.json"), ("v2", "dcp.msgpack"),
         ("v5", "COMPLETE"), ("v5", "dcp-spec.msgpack"), ("v5", "rank-table/block-00000.bin"),
         ("v5", "rank-00000/index.msgpack"), ("v5", "rank-00000/data-0.safetensors")]
READS = ("latest", "load", "verify", "verify-quick", "load-into", "cp")


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(9)
    return {"w": torch.randn(16, 8, generator=g), "b": torch.randn(3, generator=g),
            "trainer": {"step": 2}}


def _read(how: str, store: Any, tmp: Path) -> Any:
    if how == "latest":
        return store.latest()
    if how == "load":
        return store.load(1)
    if how == "verify":
        return store.verify(1)
    if how == "verify-quick":
        return store.verify(1, quick=True)
    if how == "load-into":
        return store.load(1, into={"w": torch.zeros(16, 8), "b": torch.zeros(3),
                                   "trainer": {"step": 0}})
    from ckptfs.protocol.copy import copy_step

    return copy_step(store.storage, ckptfs.open(str(tmp / "dst")).storage, 1)


def _bounded(fn: Any, fifo: Path | None, seconds: float = 60) -> BaseException | None:
    """``fn()`` in a thread; what it raised (None: it returned).  A read still waiting after
    ``seconds`` fails the test, and is released (a writer opens the FIFO)."""
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # the outcome under test
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        if fifo is not None:
            with open(fifo, "wb"):  # release the waiting reader
                pass
        t.join(10)
        pytest.fail(f"the read was still waiting after {seconds:.0f} s")
    return out[0]


@pytest.mark.parametrize("kind", ["fifo", "directory", "link-to-fifo"])
@pytest.mark.parametrize(("fmt", "rel"), FILES, ids=[f"{f}-{r}" for f, r in FILES])
def test_a_special_file_is_refused_not_waited_on(tmp_path: Path, fmt: str, rel: str,
                                                 kind: str) -> None:
    if fmt != "v1":
        pytest.importorskip("torch.distributed.checkpoint")
        from ckptfs.torch_versions import sharded_supported

        if not sharded_supported():
            pytest.skip("sharded checkpoints need a newer torch")
    store = ckptfs.open(str(tmp_path / "run"), **LAYOUTS[fmt])
    info = store.save(1, _state())
    target = tmp_path / "run" / (info.paths.dir if rel == "COMPLETE" else info.path) / rel
    target.unlink()
    fifo: Path | None = None
    if kind == "fifo":
        os.mkfifo(target)
        fifo = target
    elif kind == "directory":
        target.mkdir()
    else:
        fifo = tmp_path / "elsewhere"
        os.mkfifo(fifo)
        target.symlink_to(fifo)
    for how in READS:
        exc = _bounded(lambda how=how: _read(how, ckptfs.open(str(tmp_path / "run")), tmp_path),
                       fifo)
        if how == "latest" and exc is None:
            continue  # latest reads the marker and the manifest only
        assert isinstance(exc, CkptfsError), (how, exc)
        if how != "latest":
            assert isinstance(exc, CorruptCheckpointError) or "rank(s) [0]" in str(exc), \
                (how, exc)
        assert rel.rsplit("/", 1)[-1] in str(exc), (how, exc)


@pytest.mark.parametrize("kind", ["fifo", "file"])
def test_an_attempt_directory_that_is_not_one_is_corrupt_and_rolled_back(tmp_path: Path,
                                                                        kind: str) -> None:
    """The attempt the newest marker names is a FIFO or a file: typed, naming it, and the
    rollback reads take the step before."""
    import shutil

    store = ckptfs.open(str(tmp_path / "run"))
    store.save(1, _state())
    info = store.save(2, _state())
    attempt = tmp_path / "run" / info.path
    shutil.rmtree(attempt)
    if kind == "fifo":
        os.mkfifo(attempt)
    else:
        attempt.write_bytes(b"not a directory")
    for how in ("latest", "load"):
        exc = _bounded(lambda how=how: getattr(ckptfs.open(str(tmp_path / "run")), how)(),
                       attempt if kind == "fifo" else None)
        assert isinstance(exc, CorruptCheckpointError), (how, exc)
        assert info.attempt in str(exc), exc
    again = ckptfs.open(str(tmp_path / "run"))
    assert torch.equal(again.load(allow_rollback=True)["w"], _state()["w"])
    assert again.latest(allow_rollback=True).step == 1
