"""A store's save options are one value (`ckptfs.protocol.options.SaveOptions`), checked once
and given whole to every stage of a save: the single-process write, the collective writer
(one process of ``layout="ranks"``, the world of one), ``ckptfs.dcp.Writer``; a bad option is
refused by ``ckptfs.open`` before anything is written, naming it."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

import ckptfs
from ckptfs.errors import HashAlgorithmUnavailableError, SaveOptionError, UnsupportedValueError
from ckptfs.protocol import incremental
from ckptfs.protocol.options import SaveOptions, default_threads


def _state() -> dict[str, Any]:
    return {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "trainer": {"step": 1}}


def test_the_store_holds_one_value_with_its_options(tmp_path: Path) -> None:
    store = ckptfs.open(str(tmp_path / "run"), algorithm="sha256", durable=False, threads=3,
                        incremental=True, lease_s=12.5, metadata_layout="per-rank",
                        divergent_keys=["loss"])
    opts = store.options
    assert isinstance(opts, SaveOptions)
    assert (opts.algorithm, opts.durable, opts.threads, opts.lease_s, opts.metadata_layout,
            opts.divergent_keys, opts.node_local) == ("sha256", False, 3, 12.5, "per-rank",
                                                      ("loss",), False)
    assert opts.incremental and opts.reuse is store.reuse
    # the store's attributes read the one value
    assert (store.algorithm, store.durable, store.threads, store.lease_s) == \
        ("sha256", False, 3, 12.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        opts.threads = 5  # type: ignore[misc]
    assert ckptfs.open(str(tmp_path / "other")).options.threads == default_threads()


@pytest.mark.parametrize("layout", ["auto", pytest.param("ranks", marks=pytest.mark.sharded)])
def test_every_stage_of_a_save_gets_the_store_s_value_whole(tmp_path: Path, layout: str,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The value the write stage receives is the store's own object, for the files layout
    (`write_plan`) and the rank files of a world of one (`ShardedWriter`)."""
    seen: list[SaveOptions] = []
    real_write_plan = incremental.write_plan

    def write_plan(storage: Any, step: int, plan: Any, meta: Any, opts: SaveOptions,
                   **kw: Any) -> Any:
        seen.append(opts)
        return real_write_plan(storage, step, plan, meta, opts, **kw)

    monkeypatch.setattr("ckptfs.protocol.prepare.write_plan", write_plan)
    if layout == "ranks":  # imports DCP: sharded only (torch >= the sharded floor)
        from ckptfs.protocol import sharded_io
        real_init = sharded_io.ShardedWriter.__init__

        def init(self: Any, storage: Any, step: int, opts: SaveOptions, **kw: Any) -> None:
            seen.append(opts)
            real_init(self, storage, step, opts, **kw)

        monkeypatch.setattr(sharded_io.ShardedWriter, "__init__", init)
    store = ckptfs.open(str(tmp_path / "run"), algorithm="sha256", threads=1, layout=layout)
    info = store.save(1, _state())
    assert seen and all(o is store.options for o in seen), seen
    assert info.manifest.hash_algorithm == "sha256"
    got = store.load(1)
    assert torch.equal(got["model"]["w"], _state()["model"]["w"])


@pytest.mark.parametrize(("options", "error", "named"), [
    ({"threads": -1}, SaveOptionError, "threads=-1"),
    ({"threads": "2"}, SaveOptionError, "threads='2'"),
    ({"threads": 2.5}, SaveOptionError, "threads=2.5"),
    ({"threads": True}, SaveOptionError, "threads=True"),
    ({"lease_s": -1}, SaveOptionError, "lease_s=-1"),
    ({"lease_s": float("nan")}, SaveOptionError, "lease_s=nan"),
    ({"lease_s": float("inf")}, SaveOptionError, "lease_s=inf"),
    ({"lease_s": "60"}, SaveOptionError, "lease_s='60'"),
    ({"durable": "yes"}, SaveOptionError, "durable='yes'"),
    ({"durable": 1}, SaveOptionError, "durable=1"),
    ({"algorithm": "md5"}, HashAlgorithmUnavailableError, "md5"),
    ({"metadata_layout": "rows"}, UnsupportedValueError, "metadata_layout 'rows'"),
])
def test_a_bad_option_is_refused_naming_it_before_anything_is_written(
        tmp_path: Path, options: dict[str, Any], error: type[Exception], named: str) -> None:
    root = tmp_path / "run"
    with pytest.raises(error) as exc:
        ckptfs.open(str(root), **options)
    assert named in str(exc.value)
    assert not root.exists() or not any(root.rglob("*"))
    with pytest.raises(error):  # the value itself checks, whoever makes it
        SaveOptions(**options)


def test_accepted_edges_and_a_changed_value_is_checked_again() -> None:
    opts = SaveOptions(threads=0, lease_s=0)
    assert opts.threads == default_threads() and opts.lease_s == 0
    assert SaveOptions(threads=None).threads == default_threads()
    changed = opts.but(durable=False)
    assert changed.durable is False and opts.durable is True  # a new value, the old kept
    with pytest.raises(SaveOptionError, match="threads"):
        opts.but(threads=-3)


@pytest.mark.sharded
def test_dcp_writer_saves_with_its_store_s_options(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    from ckptfs.dcp import Writer

    url = str(tmp_path / "run")
    writer = Writer(url, 1, algorithm="sha256", threads=1, durable=False)
    assert (writer.opts.algorithm, writer.opts.threads, writer.opts.durable) == \
        ("sha256", 1, False)
    assert writer.opts.metadata_layout is None  # DCP's driver: one dcp.msgpack at any size
    assert writer.per_rank is None
    dcp.save({"w": torch.ones(4)}, storage_writer=writer, no_dist=True)
    assert ckptfs.open(url).info(1).manifest.hash_algorithm == "sha256"
