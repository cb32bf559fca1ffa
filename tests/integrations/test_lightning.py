"""ckptfs.lightning: a real Lightning Trainer with ModelCheckpoint on local disk and S3 (moto)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import os
import pathlib
import re
import tracemalloc
import warnings
from typing import Any

import lightning as L  # the lightning extra, installed by the test extra
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ckptfs
import ckptfs.lightning as ckl
from ckptfs.storage.base import StorageWrapper
from ckptfs.testing.backend import Backend

warnings.filterwarnings("ignore", module="lightning")
logging.getLogger("lightning").setLevel(logging.ERROR)
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


@dataclasses.dataclass
class OptimConfig:
    lr: float = 0.05
    momentum: float = 0.9


ckptfs.register_type(Color)
ckptfs.register_type(OptimConfig)


class Tiny(L.LightningModule):
    def __init__(self, optim: OptimConfig | None = None, out_dir: pathlib.Path | None = None,
                 args: argparse.Namespace | None = None, color: Color = Color.RED,
                 tags: set[str] | None = None, scale: Any = None, table: Any = None,
                 device_hint: torch.device | None = None, extra: Any = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.optim = optim or OptimConfig()
        self.layer = nn.Linear(4, 1)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self.layer(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.SGD(self.parameters(), lr=self.optim.lr, momentum=self.optim.momentum)
        return [opt], [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)]


class Data(L.LightningDataModule):
    def __init__(self, root: pathlib.Path = pathlib.Path("/data"), batch: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> DataLoader[Any]:
        return data()

    def val_dataloader(self) -> DataLoader[Any]:
        return data()


def data() -> DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(32, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]]) + 0.1 * torch.randn(32, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=8, shuffle=False)


class Counting(ckl.CkptfsCheckpointIO):
    """Records the paths Lightning saves and removes."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.saved: list[str] = []
        self.removed: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saved.append(str(path))

    def remove_checkpoint(self, path: Any) -> None:
        super().remove_checkpoint(path)
        self.removed.append(str(path))


@pytest.fixture(autouse=True)
def _in_tmp_dir(tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's default ModelCheckpoint (a Trainer given none) writes under the working
    directory: keep it in the test's own directory, never in the repository."""
    monkeypatch.chdir(tmp_path)


def trainer(epochs: int, *callbacks: Any, io: Any = None, **io_options: Any) -> Any:
    return L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, deterministic=True, callbacks=list(callbacks),
                     plugins=[io or ckl.CkptfsCheckpointIO(**io_options)])


def model(**kw: Any) -> Tiny:
    torch.manual_seed(1)
    return Tiny(**kw)


@pytest.fixture(params=["local", "s3"])
def where(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    backend: Backend = request.getfixturevalue(f"{request.param}_backend")
    # Lightning's ModelCheckpoint opens fsspec itself, with no options: the environment.
    for key, value in backend.env.items():
        monkeypatch.setenv(key, value)
    if backend.protocol == "s3":
        import s3fs
        s3fs.S3FileSystem.clear_instance_cache()
    return backend


def dirpath(backend: Backend) -> str:
    """A plain path on local disk: ModelCheckpoint turns ``file://...`` into a relative path."""
    return backend.url.removeprefix("file://")


def names(backend: Backend) -> set[str]:
    """Top-level names under the checkpoint directory (links and roots)."""
    return {rel.split("/", 1)[0] for rel in backend.raw_files()}


def test_top_k_last_and_resume(where: Backend) -> None:
    url, opts = dirpath(where), dict(where.options)
    ckpt = ckl.ModelCheckpoint(dirpath=url, filename="{epoch}-{step}", monitor="val_loss",
                           save_top_k=2, save_last=True)
    io = Counting(**opts)
    t = trainer(4, ckpt, io=io)
    t.fit(model(), data(), data())
    kept = {u.rsplit("/", 1)[1] for u in ckpt.best_k_models}
    assert len(kept) == 2 and io.removed, (kept, io.saved)     # top-k did delete
    assert names(where) == ({"last.ckpt", "last.ckpt.ckptfs"} | kept
                            | {k + ".ckptfs" for k in kept})
    # last.ckpt was saved n times: step n-1 of its root, the older steps deleted after commits.
    n = io.saved.count(url + "/last.ckpt")
    assert n >= 3
    last = ckptfs.open(url + "/last.ckpt.ckptfs", **opts)
    assert last.steps() == last.all_steps() == [n - 1]
    link = json.loads(where.raw_read("last.ckpt"))
    assert link["root"] == "last.ckpt.ckptfs" and link["step"] == n - 1
    for k in kept:
        assert ckptfs.open(f"{url}/{k}.ckptfs", **opts).all_steps() == [0]

    # Resume from "last" (a fresh Trainer and module): continues at epoch 4, step 16.
    ckpt2 = ckl.ModelCheckpoint(dirpath=url, filename="{epoch}-{step}", monitor="val_loss",
                            save_top_k=2, save_last=True)
    t2 = trainer(5, ckpt2, **opts)
    t2.fit(model(), data(), data(), ckpt_path="last")
    assert t2.global_step == 20 and t2.current_epoch == 5
    assert not any("-v" in name for name in names(where)), names(where)
    assert ckptfs.open(url + "/last.ckpt.ckptfs", **opts).steps() == [n]
    assert {u.rsplit("/", 1)[1] for u in ckpt2.best_k_models} <= names(where)

    # Resume from an explicit path: the state at that point is the saved one.
    path = sorted(ckpt2.best_k_models)[0]
    state = ckl.CkptfsCheckpointIO(**opts).load_checkpoint(path)
    t3 = trainer(state["epoch"] + 1, **opts)
    m3 = model()
    t3.fit(m3, data(), data(), ckpt_path=path)
    assert t3.global_step == state["global_step"]  # nothing left to train: the saved state
    for k, v in m3.state_dict().items():
        assert torch.equal(v, state["state_dict"][k])


def test_resume_from_last_matches_uninterrupted(local_backend: Backend) -> None:
    url = dirpath(local_backend)
    ref = trainer(4)
    m_ref = model()
    ref.fit(m_ref, data(), data())

    t1 = trainer(2, ModelCheckpoint(dirpath=url, save_top_k=0, save_last=True))
    t1.fit(model(), data(), data())
    t2 = trainer(4, ModelCheckpoint(dirpath=url, save_top_k=0, save_last=True))
    m2 = Tiny()                                   # different initial weights: all restored
    t2.fit(m2, data(), data(), ckpt_path="last")
    assert t2.global_step == ref.global_step == 16
    for k, v in m_ref.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    opt_ref, opt2 = ref.optimizers[0].state_dict(), t2.optimizers[0].state_dict()
    for p in opt_ref["state"]:
        assert torch.equal(opt_ref["state"][p]["momentum_buffer"],
                           opt2["state"][p]["momentum_buffer"])
    assert ref.lr_scheduler_configs[0].scheduler.get_last_lr() == \
        t2.lr_scheduler_configs[0].scheduler.get_last_lr()


def test_same_path_resaved_and_hparams_round_trip(where: Backend) -> None:
    """A fixed filename with save_top_k=1 re-saves the same path (as torch.save overwrites);
    the hyper-parameter types users have come back as themselves."""
    url, opts = dirpath(where), dict(where.options)
    hp = dict(optim=OptimConfig(lr=0.02), out_dir=pathlib.Path("/data/out"),
              args=argparse.Namespace(seed=3, name="x"), color=Color.BLUE, tags={"a", "b"},
              scale=np.float32(0.5), table=np.arange(6, dtype=np.int64).reshape(2, 3),
              device_hint=torch.device("cpu"), extra=frozenset({1, 2}))
    ckpt = ModelCheckpoint(dirpath=url, filename="best", monitor="val_loss", mode="min",
                           save_top_k=1)
    io = Counting(**opts)
    t = trainer(4, ckpt, io=io)
    t.fit(model(**hp), datamodule=Data(pathlib.Path("/data/set1"), batch=8))
    assert names(where) == {"best.ckpt", "best.ckpt.ckptfs"}
    n = len(io.saved)
    assert n >= 2 and set(io.saved) == {url + "/best.ckpt"} and not io.removed
    root = ckptfs.open(url + "/best.ckpt.ckptfs", **opts)
    assert root.steps() == root.all_steps() == [n - 1]     # saved n times, one step kept

    state = ckl.CkptfsCheckpointIO(**opts).load_checkpoint(url + "/best.ckpt")
    loaded = ckl.load_from_checkpoint(Tiny, url + "/best.ckpt", storage_options=opts)
    assert isinstance(loaded, Tiny)
    for k, v in loaded.state_dict().items():
        assert torch.equal(v, state["state_dict"][k])
    got = loaded.hparams
    assert got["optim"] == OptimConfig(lr=0.02) and type(got["optim"]) is OptimConfig
    assert got["out_dir"] == pathlib.Path("/data/out") and isinstance(got["out_dir"], pathlib.Path)
    assert got["args"] == argparse.Namespace(seed=3, name="x")
    assert got["color"] is Color.BLUE
    assert got["tags"] == {"a", "b"} and type(got["tags"]) is set
    assert got["extra"] == frozenset({1, 2}) and type(got["extra"]) is frozenset
    assert type(got["scale"]) is np.float32 and got["scale"] == np.float32(0.5)
    assert isinstance(got["table"], np.ndarray) and np.array_equal(got["table"], hp["table"])
    assert got["device_hint"] == torch.device("cpu")
    # kwargs override the stored hyper-parameters, as in Lightning
    over = ckl.load_from_checkpoint(Tiny, url + "/best.ckpt", storage_options=opts,
                                    color=Color.RED)
    assert over.hparams["color"] is Color.RED
    dm = ckl.load_from_checkpoint(Data, url + "/best.ckpt", storage_options=opts, batch=4)
    assert isinstance(dm, Data) and dm.hparams["root"] == pathlib.Path("/data/set1")
    assert dm.hparams["batch"] == 4
    with pytest.raises(ckptfs.UnsupportedValueError, match="LightningModule"):
        ckl.load_from_checkpoint(dict, url + "/best.ckpt", storage_options=opts)

    for key in ("loops", "callbacks", "optimizer_states", "lr_schedulers", "hparams_name",
                "pytorch-lightning_version", "state_dict", "hyper_parameters"):
        assert key in state, key
    sched = state["lr_schedulers"][0]
    assert sched["gamma"] == 0.7 and sched["step_size"] == 1
    assert isinstance(sched["_last_lr"], list) and isinstance(sched["_last_lr"][0], float)
    assert state["optimizer_states"][0]["param_groups"][0]["momentum"] == 0.9
    ck_state = next(v for k, v in state["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert ck_state["best_model_path"] == ckpt.best_model_path

    # The whole dict Lightning builds round-trips: same keys, types, values.
    dumped = t._checkpoint_connector.dump_checkpoint(weights_only=False)
    io2 = ckl.CkptfsCheckpointIO(**opts)
    io2.save_checkpoint(dumped, url + "/dump.ckpt")
    same(dumped, io2.load_checkpoint(url + "/dump.ckpt"), "")


def same(a: Any, b: Any, where: str) -> None:
    assert type(a) is type(b) or (isinstance(a, dict) and type(b) is dict), (where, a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and np.array_equal(a, b), where
    elif isinstance(a, dict):
        assert list(a) == list(b), where
        for k in a:
            same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}/{i}")
    else:
        assert a == b, (where, a, b)


def test_remove_leaves_nothing_and_no_versioned_names(where: Backend) -> None:
    url, opts = dirpath(where), dict(where.options)
    io = ckl.CkptfsCheckpointIO(**opts)
    path = url + "/epoch=0-step=4.ckpt"
    io.save_checkpoint({"state_dict": {"w": torch.ones(2)}, "epoch": 0}, path)
    io.save_checkpoint({"state_dict": {"w": torch.zeros(2)}, "epoch": 0}, path)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["w"], torch.zeros(2))
    # an incomplete attempt of an older step (a crashed save) goes with the next commit
    where.raw_write("epoch=0-step=4.ckpt.ckptfs/checkpoints/step-000000000000/a-x/f.bin", b"x")
    io.save_checkpoint({"state_dict": {"w": torch.full((2,), 2.0)}}, path)
    assert ckptfs.open(url + "/epoch=0-step=4.ckpt.ckptfs", **opts).all_steps() == [2]

    ckpt = ModelCheckpoint(dirpath=url, filename="{epoch}-{step}")
    t = trainer(1, ckpt, **opts)
    ckpt.setup(t, model(), "fit")
    assert ckpt.file_exists(path, t)
    io.remove_checkpoint(path)
    assert where.raw_files() == {}
    assert not ckpt.file_exists(path, t)
    cands = {"epoch": torch.tensor(0), "step": torch.tensor(4)}
    assert ckpt._get_metric_interpolated_filepath_name(cands, t) == path   # not -v1
    io.remove_checkpoint(path)                                           # absent: no error
    assert ckl.ModelCheckpoint(dirpath="file:///tmp/abs/dir").dirpath == "/tmp/abs/dir"
    with pytest.raises(ckptfs.CheckpointNotFoundError, match=re.escape("epoch=0-step=4.ckpt")):
        io.load_checkpoint(path)


def test_refused_value_names_key_and_writes_nothing(local_backend: Backend) -> None:
    io = ckl.CkptfsCheckpointIO()
    path = dirpath(local_backend) + "/last.ckpt"
    with pytest.raises(ckptfs.UnsupportedValueError, match=r"hyper_parameters.*fn"):
        io.save_checkpoint({"state_dict": {}, "hyper_parameters": {"fn": print}}, path)
    assert local_backend.raw_files() == {}
    with pytest.raises(ckptfs.UnsupportedValueError, match="storage_options"):
        io.save_checkpoint({}, path, storage_options={"x": 1})


def test_link_files_are_checked(local_backend: Backend) -> None:
    url = dirpath(local_backend)
    io = ckl.CkptfsCheckpointIO()
    directory = pathlib.Path(url)
    directory.mkdir(parents=True)
    torch.save({"state_dict": {}}, directory / "plain.ckpt")
    with pytest.raises(ckptfs.CheckpointNotFoundError, match=r"torch\.load"):
        io.load_checkpoint(url + "/plain.ckpt")
    io.save_checkpoint({"w": torch.ones(1)}, url + "/a.ckpt")
    # a link naming a root outside its directory is ignored: the path's own root is used
    local_backend.raw_write("a.ckpt", json.dumps(
        {"format": ckl.LINK_FORMAT, "root": "../elsewhere.ckptfs"}).encode())
    assert torch.equal(io.load_checkpoint(url + "/a.ckpt")["w"], torch.ones(1))
    # a copied link (save_last="link" on a filesystem without symlinks) names its root
    io.save_checkpoint({"w": torch.zeros(1)}, url + "/b.ckpt")
    local_backend.raw_write("last.ckpt", local_backend.raw_read("b.ckpt"))
    assert torch.equal(io.load_checkpoint(url + "/last.ckpt")["w"], torch.zeros(1))
    # a torn link write falls back to the root, which is the truth
    local_backend.raw_write("b.ckpt", b'{"format": "ckptfs-lig')
    assert torch.equal(io.load_checkpoint(url + "/b.ckpt")["w"], torch.zeros(1))


def test_save_last_link_loads_the_linked_checkpoint(local_backend: Backend) -> None:
    """save_last="link": Lightning symlinks last.ckpt to the newest top-k link file, whose
    content names that checkpoint's root."""
    url = dirpath(local_backend)
    ckpt = ModelCheckpoint(dirpath=url, filename="{epoch}-{step}", save_top_k=1,
                           save_last="link")
    t = trainer(2, ckpt)
    t.fit(model(), data(), data())
    assert pathlib.Path(url, "last.ckpt").is_symlink()
    assert not pathlib.Path(url, "last.ckpt.ckptfs").exists()
    io = ckl.CkptfsCheckpointIO()
    state = io.load_checkpoint(url + "/last.ckpt")
    assert state["global_step"] == t.global_step == 8
    for k, v in t.lightning_module.state_dict().items():
        assert torch.equal(v, state["state_dict"][k])
    t2 = trainer(3, ModelCheckpoint(dirpath=url, filename="{epoch}-{step}", save_top_k=1,
                                    save_last="link"))
    t2.fit(model(), data(), data(), ckpt_path="last")
    assert t2.global_step == 12


# -- saving or removing a path never changes what another path resolves to -----------------------


def w_of(io: ckl.CkptfsCheckpointIO, path: str) -> float:
    return float(io.load_checkpoint(path)["w"][0])


def test_save_and_remove_through_symlinks_leave_other_paths_alone(
        local_backend: Backend) -> None:
    """save_last="link" leaves last.ckpt as a symbolic link to a top-k link file: saving
    last.ckpt must replace the symbolic link, not rewrite the top-k file it points to, and
    removing it must remove only the link.  The same for a run root that is a link."""
    url = dirpath(local_backend)
    d = pathlib.Path(url)
    io = ckl.CkptfsCheckpointIO()
    io.save_checkpoint({"w": torch.full((1,), 1.0)}, url + "/top.ckpt")
    top_link = (d / "top.ckpt").read_bytes()
    top_steps = ckptfs.open(url + "/top.ckpt.ckptfs").all_steps()

    def top_untouched() -> None:
        assert (d / "top.ckpt").read_bytes() == top_link
        assert ckptfs.open(url + "/top.ckpt.ckptfs").all_steps() == top_steps
        assert w_of(io, url + "/top.ckpt") == 1.0

    # last.ckpt -> top.ckpt, as Lightning's _link_checkpoint makes it (relative)
    (d / "last.ckpt").symlink_to("top.ckpt")
    assert w_of(io, url + "/last.ckpt") == 1.0            # the link loads its target
    io.save_checkpoint({"w": torch.full((1,), 2.0)}, url + "/last.ckpt")
    top_untouched()
    assert not (d / "last.ckpt").is_symlink()
    assert json.loads((d / "last.ckpt").read_bytes())["root"] == "last.ckpt.ckptfs"
    assert w_of(io, url + "/last.ckpt") == 2.0
    io.remove_checkpoint(url + "/last.ckpt")
    top_untouched()
    assert not (d / "last.ckpt").exists() and not (d / "last.ckpt.ckptfs").exists()

    # removing a symbolic link removes the link only
    (d / "last.ckpt").symlink_to("top.ckpt")
    io.remove_checkpoint(url + "/last.ckpt")
    top_untouched()
    assert not os.path.lexists(d / "last.ckpt")

    # a dangling symbolic link: saving creates no file where it points
    (d / "dangling.ckpt").symlink_to("nowhere.ckpt")
    io.save_checkpoint({"w": torch.full((1,), 3.0)}, url + "/dangling.ckpt")
    assert not os.path.lexists(d / "nowhere.ckpt") and w_of(io, url + "/dangling.ckpt") == 3.0

    # a run root that is a symbolic link to another path's root: never committed into or pruned
    (d / "other.ckpt.ckptfs").symlink_to("top.ckpt.ckptfs", target_is_directory=True)
    io.save_checkpoint({"w": torch.full((1,), 4.0)}, url + "/other.ckpt")
    top_untouched()
    assert (d / "other.ckpt.ckptfs").is_dir() and not (d / "other.ckpt.ckptfs").is_symlink()
    assert w_of(io, url + "/other.ckpt") == 4.0
    (d / "gone.ckpt.ckptfs").symlink_to("top.ckpt.ckptfs", target_is_directory=True)
    (d / "gone.ckpt").symlink_to("top.ckpt")
    io.remove_checkpoint(url + "/gone.ckpt")
    top_untouched()
    assert not os.path.lexists(d / "gone.ckpt") and not os.path.lexists(d / "gone.ckpt.ckptfs")


def test_save_last_link_then_saved_last_keeps_top_k_weights(local_backend: Backend) -> None:
    """A run with save_last="link", resumed with save_last=True: Lightning then saves
    last.ckpt over its symbolic link.  Every top-k path still loads its own weights, and
    removing last.ckpt leaves them loadable."""
    url = dirpath(local_backend)
    t = trainer(2, ModelCheckpoint(dirpath=url, filename="{epoch}-{step}", save_top_k=-1,
                                   save_last="link"))
    t.fit(model(), data(), data())
    assert pathlib.Path(url, "last.ckpt").is_symlink()
    io = ckl.CkptfsCheckpointIO()
    tops = sorted(p.name for p in pathlib.Path(url).glob("epoch=*.ckpt"))
    before = {p: io.load_checkpoint(f"{url}/{p}")["state_dict"] for p in tops}
    t2 = trainer(3, ModelCheckpoint(dirpath=url, filename="{epoch}-{step}", save_top_k=0,
                                    save_last=True))
    t2.fit(model(), data(), data(), ckpt_path="last")
    assert not pathlib.Path(url, "last.ckpt").is_symlink()
    assert io.load_checkpoint(url + "/last.ckpt")["global_step"] == t2.global_step == 12
    for p in tops:
        state = io.load_checkpoint(f"{url}/{p}")
        assert state["global_step"] == int(re.search(r"step=(\d+)", p)[1])  # type: ignore[index]
        for k, v in before[p].items():
            assert torch.equal(state["state_dict"][k], v), (p, k)
    io.remove_checkpoint(url + "/last.ckpt")
    for p in tops:
        assert io.load_checkpoint(f"{url}/{p}")["global_step"] == \
            int(re.search(r"step=(\d+)", p)[1])  # type: ignore[index]


class _ReadCounting(StorageWrapper):
    """Counts the bytes read through every read member."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.read: dict[str, int] = {}

    def _add(self, path: str, n: int) -> None:
        self.read[path] = self.read.get(path, 0) + n

    def read_bytes(self, path: str) -> bytes:
        data = super().read_bytes(path)
        self._add(path, len(data))
        return data

    def read_range(self, path: str, start: int, length: int) -> bytes:
        data = super().read_range(path, start, length)
        self._add(path, len(data))
        return data

    def open_read(self, path: str) -> Any:
        self._add(path, 1 << 40)  # a stream: count it as everything
        return super().open_read(path)


def test_link_file_read_is_bounded(local_backend: Backend,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A large file at the path is not read whole: at most 64 KiB + 1 byte of it."""
    url = dirpath(local_backend)
    pathlib.Path(url).mkdir(parents=True)
    with open(f"{url}/big.ckpt", "wb") as f:      # 64 MiB, sparse: costs no disk
        f.truncate(64 << 20)
    io = ckl.CkptfsCheckpointIO()
    counting: list[_ReadCounting] = []
    opened = ckl.CkptfsCheckpointIO._dir

    def counted(self: ckl.CkptfsCheckpointIO, u: str) -> ckptfs.CheckpointStore:
        store = opened(self, u)
        wrapper = _ReadCounting(store.storage)
        counting.append(wrapper)
        return ckptfs.CheckpointStore(wrapper)

    monkeypatch.setattr(ckl.CkptfsCheckpointIO, "_dir", counted)
    tracemalloc.start()
    try:
        with pytest.raises(ckptfs.CheckpointNotFoundError, match=r"torch\.load"):
            io.load_checkpoint(url + "/big.ckpt")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    read = sum(c.read.get("big.ckpt", 0) for c in counting)
    assert 0 < read <= 64 * 1024 + 1, read
    assert peak < 8 << 20, peak


@pytest.mark.parametrize("raw", [
    b"[" * 30000 + b"]" * 30000,
    b'{"a":' * 10000 + b"1" + b"}" * 10000,
    json.dumps({"format": ckl.LINK_FORMAT, "root": "x.ckpt.ckptfs"}).encode()[:-1]
    + b', "extra": ' + b"[" * 20000 + b"]" * 20000 + b"}",
], ids=["arrays", "objects", "nested-field"])
def test_deeply_nested_link_falls_back(local_backend: Backend, raw: bytes) -> None:
    """Deeply nested JSON at the path is not a link (no RecursionError): the path's own root
    is used if it holds a checkpoint, else CheckpointNotFoundError."""
    url = dirpath(local_backend)
    io = ckl.CkptfsCheckpointIO()
    pathlib.Path(url).mkdir(parents=True)
    assert len(raw) <= 64 * 1024
    local_backend.raw_write("x.ckpt", raw)
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="not a ckptfs Lightning"):
        io.load_checkpoint(url + "/x.ckpt")
    io.save_checkpoint({"w": torch.full((1,), 5.0)}, url + "/x.ckpt")
    local_backend.raw_write("x.ckpt", raw)       # a torn or foreign link: the root is the truth
    assert w_of(io, url + "/x.ckpt") == 5.0
    # brackets inside strings do not count as nesting: a real link with them still loads
    local_backend.raw_write("x.ckpt", json.dumps(
        {"format": ckl.LINK_FORMAT, "root": "x.ckpt.ckptfs", "note": "[[[[[[{{{{{\\\""}
    ).encode())
    assert w_of(io, url + "/x.ckpt") == 5.0
