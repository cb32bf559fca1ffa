"""ckptfs.lightning: a real Lightning Trainer with ModelCheckpoint on local disk and S3 (moto)."""

from __future__ import annotations

import argparse
import dataclasses
import enum
import json
import logging
import pathlib
import re
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
