"""ckptfs.torch_checkpointing: torch_checkpointing's own storage tests against `CkptfsStorage`,
the ``Storage.rename`` contract, verification on read, and a save / kill / resume loop through
its ``CheckpointManager`` on every backend.

Run as a script (``python this_file.py '<json>'``), it is the training job the loop kills.
"""

from __future__ import annotations

import array
import io
import json
import os
import re
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("torch_checkpointing", reason="pip install 'ckptfs[torch-checkpointing]'")

import numpy as np
from torch_checkpointing.checkpoint_manager import CheckpointManager
from torch_checkpointing.config import AsyncCheckpointSaverConfig, SyncCheckpointSaverConfig
from torch_checkpointing.default_resharder import DefaultResharder
from torch_checkpointing.schema import ItemSpec
from torch_checkpointing.storage.base_storage import ReadArgs, Storage

from ckptfs.errors import CorruptCheckpointError
from ckptfs.testing.backend import Backend
from ckptfs.torch_checkpointing import CkptfsStorage, CkptfsStorageConfig

FOLDER = "outputs/checkpoint"
STEPS = 4
KILL_AT = 3  # the job dies inside the save of this step, before its commit


def config(backend: Backend, **kw: Any) -> CkptfsStorageConfig:
    return CkptfsStorageConfig(url=backend.url, storage_options=dict(backend.options), **kw)


@pytest.fixture(params=["local", "memory", "s3", pytest.param("gcs", marks=pytest.mark.slow),
                        pytest.param("azure", marks=pytest.mark.slow)])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Backend:
    b: Backend = request.getfixturevalue(f"{request.param}_backend")
    for key, value in b.env.items():
        monkeypatch.setenv(key, value)
    return b


# -- torch_checkpointing's own storage tests ---------------------------------------------------
# Adapted from meta-pytorch/torch_checkpointing tests/test_local_filesystem.py (commit e57668f,
# BSD-style licence, Copyright (c) Meta Platforms, Inc. and affiliates): the same calls and
# assertions, with the storage under test built from a URL and the checks that looked at the
# local disk with ``os.path`` asked of the storage (the store may be remote).

class TestStorageUpstream:
    @pytest.fixture(autouse=True)
    def _setup(self, backend: Backend) -> None:
        self.storage: Storage = config(backend).create_storage()
        self.temp_dir = "test_storage"
        self.storage.mkdir(Path(self.temp_dir))
        self.bytes_data = b"Hello bytes! "
        self.bytearray_data = bytearray(b"Hello bytearray! ")
        self.numpy_array = np.array([1, 2, 3, 4, 5], dtype=np.int32)
        self.torch_tensor = torch.tensor([10, 20, 30, 40, 50], dtype=torch.int32)
        self.python_array = array.array("i", [100, 200, 300, 400, 500])
        self.expected_content = (self.bytes_data + bytes(self.bytearray_data)
                                 + self.numpy_array.tobytes()
                                 + self.torch_tensor.numpy().tobytes()
                                 + self.python_array.tobytes())

    def write_data_using_write(self, file_path: str) -> None:
        self.storage.write(Path(file_path), self.expected_content)

    def write_data_using_stream_write(self, file_path: str) -> None:
        stream = self.storage.stream_write(Path(file_path))
        with stream:
            stream.write(self.bytes_data)
            stream.write(self.bytearray_data)
            stream.write(self.numpy_array)
            stream.write(self.torch_tensor.numpy())
            stream.write(self.python_array)

    def return_ls_check(self, paths_with_expected: list[tuple[str, list[str]]]) -> None:
        for path, expected in paths_with_expected:
            assert sorted(self.storage.ls(Path(path))) == sorted(expected), path

    def test_local_filesystem(self) -> None:
        dir_level1_path = os.path.join(self.temp_dir, "dir_level1")
        dir_level2_path = os.path.join(dir_level1_path, "dir_level2")
        self.storage.mkdir(Path(dir_level1_path), recursive=True)
        self.storage.mkdir(Path(dir_level2_path), recursive=True)
        assert self.storage.exists(Path(dir_level1_path))
        assert self.storage.exists(Path(dir_level2_path))

        write_output_file = os.path.join(dir_level1_path, "write_output.bin")
        self.write_data_using_write(write_output_file)
        assert self.storage.exists(Path(write_output_file))
        assert self.storage.read(Path(write_output_file)) == self.expected_content

        stream_write_output_file = os.path.join(dir_level2_path, "stream_write_output.bin")
        self.write_data_using_stream_write(stream_write_output_file)
        assert self.storage.exists(Path(stream_write_output_file))
        assert self.storage.read(Path(stream_write_output_file)) == self.expected_content

        self.return_ls_check([(self.temp_dir, ["dir_level1"]),
                              (dir_level1_path, ["dir_level2", "write_output.bin"]),
                              (dir_level2_path, ["stream_write_output.bin"])])

        renamed_file = os.path.join(dir_level2_path, "renamed_stream_write.bin")
        self.storage.rename(Path(stream_write_output_file), Path(renamed_file))
        assert not self.storage.exists(Path(stream_write_output_file))
        assert self.storage.exists(Path(renamed_file))
        assert self.storage.read(Path(renamed_file)) == self.expected_content
        self.return_ls_check([(dir_level2_path, ["renamed_stream_write.bin"])])

        self.storage.delete(Path(write_output_file))
        self.storage.delete(Path(renamed_file))
        assert not self.storage.exists(Path(write_output_file))
        assert not self.storage.exists(Path(renamed_file))
        self.return_ls_check([(dir_level1_path, ["dir_level2"]), (dir_level2_path, [])])

        self.storage.rmdir(Path(dir_level1_path))
        assert not self.storage.exists(Path(dir_level1_path))
        assert not self.storage.exists(Path(dir_level2_path))

    def test_write_fails_if_parent_dir_not_created(self) -> None:
        nonexistent_dir = os.path.join(self.temp_dir, "nonexistent_dir")
        test_file = os.path.join(nonexistent_dir, "test_file.bin")
        assert not self.storage.exists(Path(nonexistent_dir))
        with pytest.raises(RuntimeError):
            self.storage.write(Path(test_file), b"test data")
        with pytest.raises(RuntimeError):
            stream = self.storage.stream_write(Path(test_file))
            with stream:
                stream.write(b"test data")
        assert not self.storage.exists(Path(test_file))
        self.storage.mkdir(Path(nonexistent_dir))
        assert self.storage.exists(Path(nonexistent_dir))
        self.storage.write(Path(test_file), b"test data")
        assert self.storage.exists(Path(test_file))
        assert self.storage.read(Path(test_file)) == b"test data"


# -- the rename contract (torch_checkpointing's base_storage.Storage.rename table) -------------

def make_dir(st: Storage, name: str, files: dict[str, bytes]) -> None:
    st.mkdir(Path(name))
    for rel, data in files.items():
        st.mkdir(Path(name, rel).parent)
        st.write(Path(name, rel), data)


def test_rename_contract(backend: Backend) -> None:
    st = config(backend).create_storage()
    # directory -> absent: the contents land AT dst (not nested), the source disappears
    make_dir(st, "r/tmp_a", {"x.bin": b"xx", "sub/y.bin": b"yyy"})
    st.rename(Path("r/tmp_a"), Path("r/a"), is_directory=True)
    assert st.ls(Path("r")) == ["a"]
    assert sorted(st.ls(Path("r/a"))) == ["sub", "x.bin"]
    assert st.read(Path("r/a/sub/y.bin")) == b"yyy" and st.getsize(Path("r/a/x.bin")) == 2
    assert not st.exists(Path("r/tmp_a")) and st.isdir(Path("r/a/sub"))
    # directory -> empty directory: commit replaces it
    make_dir(st, "r/tmp_b", {"x.bin": b"b"})
    st.mkdir(Path("r/b"))
    st.rename(Path("r/tmp_b"), Path("r/b"), is_directory=True)
    assert st.read(Path("r/b/x.bin")) == b"b" and st.ls(Path("r/b")) == ["x.bin"]
    # directory -> populated directory (committed or plain): raises, nothing merged
    make_dir(st, "r/tmp_c", {"z.bin": b"c"})
    with pytest.raises(OSError):
        st.rename(Path("r/tmp_c"), Path("r/a"), is_directory=True)
    make_dir(st, "r/d", {"keep.bin": b"d"})
    with pytest.raises(OSError):
        st.rename(Path("r/tmp_c"), Path("r/d"), is_directory=True)
    assert sorted(st.ls(Path("r/a"))) == ["sub", "x.bin"] and st.ls(Path("r/d")) == ["keep.bin"]
    # directory -> file: raises
    st.write(Path("r/f.bin"), b"f")
    with pytest.raises(OSError):
        st.rename(Path("r/tmp_c"), Path("r/f.bin"), is_directory=True)
    assert st.ls(Path("r/tmp_c")) == ["z.bin"]
    # file -> absent, file -> file (replaced), file -> directory (raises)
    st.rename(Path("r/f.bin"), Path("r/g.bin"))
    assert not st.exists(Path("r/f.bin")) and st.read(Path("r/g.bin")) == b"f"
    st.write(Path("r/h.bin"), b"h")
    st.rename(Path("r/h.bin"), Path("r/g.bin"))
    assert st.read(Path("r/g.bin")) == b"h" and not st.exists(Path("r/h.bin"))
    with pytest.raises(OSError):
        st.rename(Path("r/g.bin"), Path("r/d"))
    with pytest.raises(OSError):
        st.rename(Path("r/g.bin"), Path("r/a"))
    assert sorted(st.ls(Path("r"))) == ["a", "b", "d", "g.bin", "tmp_c"]


def test_committed_directory_is_immutable_and_rmdir_removes_it(backend: Backend) -> None:
    st = config(backend).create_storage()
    make_dir(st, "r/tmp_a", {"x.bin": b"xx"})
    st.rename(Path("r/tmp_a"), Path("r/a"), is_directory=True)
    for op in (lambda: st.write(Path("r/a/new.bin"), b"n"), lambda: st.delete(Path("r/a/x.bin")),
               lambda: st.mkdir(Path("r/a/sub"))):
        with pytest.raises(OSError, match="committed"):
            op()
    # its files stay in tmp_a, which is as fixed (a second save of the same step lands there)
    for op in (lambda: st.write(Path("r/tmp_a/x.bin"), b"n"), lambda: st.mkdir(Path("r/tmp_a")),
               lambda: st.rmdir(Path("r/tmp_a")), lambda: st.delete(Path("r/tmp_a/x.bin"))):
        with pytest.raises(OSError, match="holds the files of the committed"):
            op()
    assert st.read(Path("r/a/x.bin")) == b"xx"
    with pytest.raises(ValueError, match="reserved"):
        st.write(Path("r/.ckptfs-commit.b"), b"{}")
    st.rmdir(Path("r/a"))
    assert st.ls(Path("r")) == [] and not st.exists(Path("r/a"))
    left = backend.raw_files("r")  # the marker and the source's files are gone
    assert all(k.rsplit("/", 1)[-1] == ".ckptfs-dir" for k in left), left


def test_two_commits_of_one_name_exactly_one_wins(backend: Backend) -> None:
    a, b = config(backend).create_storage(), config(backend).create_storage()
    make_dir(a, "r/tmp_s1", {"w.bin": b"one"})
    make_dir(b, "r/tmp_s2", {"w.bin": b"two"})
    a.rename(Path("r/tmp_s1"), Path("r/step-1"), is_directory=True)
    with pytest.raises(FileExistsError):
        b.rename(Path("r/tmp_s2"), Path("r/step-1"), is_directory=True)
    assert b.read(Path("r/step-1/w.bin")) == b"one"


def test_a_directory_committed_again_elsewhere_is_read_fresh(backend: Backend) -> None:
    reader, other = config(backend).create_storage(), config(backend).create_storage()
    make_dir(other, "r/tmp_a", {"x.bin": b"first"})
    other.rename(Path("r/tmp_a"), Path("r/a"), is_directory=True)
    assert reader.read(Path("r/a/x.bin")) == b"first"  # its marker is cached now
    other.rmdir(Path("r/a"))
    make_dir(other, "r/tmp_a", {"x.bin": b"second!"})
    other.rename(Path("r/tmp_a"), Path("r/a"), is_directory=True)
    assert reader.read(Path("r/a/x.bin")) == b"second!"


def test_paths_map_under_the_url(tmp_path: Path) -> None:
    st = CkptfsStorageConfig(url=f"memory://{tmp_path.name}", mount="/job/out").create_storage()
    assert st.remap_path(Path("/job/out/ckpt/step-1")) == f"memory://{tmp_path.name}/ckpt/step-1"
    assert st.remap_path(Path("ckpt")) == f"memory://{tmp_path.name}/ckpt"
    for bad in ("/elsewhere/ckpt", "../up"):
        with pytest.raises(ValueError, match=re.escape(bad.lstrip("."))):
            st.remap_path(Path(bad))
    with pytest.raises(ValueError, match="url="):
        CkptfsStorageConfig().create_storage()


# -- verification ------------------------------------------------------------------------------

def test_flipped_byte_after_commit_is_refused_naming_the_file(backend: Backend) -> None:
    cfg = config(backend, block_size=64)
    m = model(0)
    mgr = manager(cfg)
    mgr.save(f"{FOLDER}/step-1", {"model": m.state_dict(), "trainer": {"step": 1}})
    st = cfg.create_storage()
    rec = st.committed(Path(FOLDER, "step-1"))
    assert rec is not None and "model_0.pt" in rec.files
    assert st.getsize(Path(FOLDER, "step-1", "model_0.pt")) == rec.files["model_0.pt"].size
    raw = f"{rec.source}/model_0.pt"
    data = bytearray(backend.raw_read(raw))
    pos = len(data) // 2
    data[pos] ^= 0x01
    backend.raw_write(raw, bytes(data))
    with pytest.raises(CorruptCheckpointError, match=r"step-1/model_0\.pt") as info:
        mgr.load(f"{FOLDER}/step-1", into={"model": model(1).state_dict(), "trainer": None})
    assert info.value.path is not None and info.value.path.endswith("step-1/model_0.pt")
    # a ranged read that touches only other blocks still works; the flipped block is refused
    reader = st.stream_read(Path(FOLDER, "step-1", "model_0.pt"),
                            ReadArgs(pre_read_full_file=False))
    assert reader.readinto(bytearray(16)) == 16
    reader.seek(pos)
    with pytest.raises(CorruptCheckpointError):
        reader.readinto(bytearray(1))
    mgr.close()


def test_ranged_reads_serve_torch_load_as_the_resharder_does(backend: Backend) -> None:
    """The resharder's offset reads: ``zipfile`` over the stream, then ``torch.load`` of it
    (seek + readinto across many small blocks, each checked)."""
    cfg = config(backend, block_size=100)
    st = cfg.create_storage()
    m = model(3)
    st.mkdir(Path("r/tmp_a"))
    with st.stream_write(Path("r/tmp_a/model.pt")) as f:
        torch.save(m.state_dict(), f)
    st.rename(Path("r/tmp_a"), Path("r/a"), is_directory=True)
    stream = st.stream_read(Path("r/a/model.pt"), ReadArgs(pre_read_full_file=False))
    with zipfile.ZipFile(stream) as archive:  # type: ignore[arg-type]
        assert archive.namelist()
    stream.seek(0)
    assert_same(torch.load(stream, weights_only=True), m.state_dict())  # type: ignore[arg-type]
    stream.seek(0, io.SEEK_END)
    assert stream.tell() == st.getsize(Path("r/a/model.pt")) and stream.read(10) == b""


def test_truncated_file_is_refused(backend: Backend) -> None:
    st = config(backend).create_storage()
    make_dir(st, "r/tmp_a", {"x.bin": b"0123456789"})
    st.rename(Path("r/tmp_a"), Path("r/a"), is_directory=True)
    backend.raw_write("r/tmp_a/x.bin", b"01234")
    with pytest.raises(CorruptCheckpointError, match=r"x\.bin"):
        st.read(Path("r/a/x.bin"))


# -- save / kill / resume with CheckpointManager -----------------------------------------------

class Tiny(torch.nn.Module):  # type: ignore[misc, name-defined]
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(6, 4)


def model(seed: int) -> Tiny:
    torch.manual_seed(seed)
    return Tiny()


def manager(cfg: CkptfsStorageConfig, **kw: Any) -> Any:
    return CheckpointManager.Config(
        items={"model": ItemSpec(resharder=DefaultResharder())},
        save=SyncCheckpointSaverConfig(), storage_config=cfg, **kw).build()


def train_step(m: Tiny, opt: Any, step: int) -> None:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(8, 6, generator=g)
    loss = m.lin(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def run_training(cfg: CkptfsStorageConfig, start: int, m: Tiny, opt: Any,
                 die_at: int | None, die: str) -> None:
    """Train steps ``start+1..STEPS``, saving after each; at ``die_at`` the job dies inside the
    save, after its files are written and before the commit (SIGKILL, or an exception)."""
    def pre_finalize(args: Any) -> None:
        if die_at is not None and args.path.endswith(f"tmp_step-{die_at}"):
            if die == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError("simulated crash mid-save")

    for step in range(start + 1, STEPS + 1):
        train_step(m, opt, step)
        # A manager per save: torch_checkpointing 0.1.1's synchronous saver writes
        # metadata.pkl (what torchtitan's step discovery looks for) only in a manager's first
        # save; its asynchronous saver (torchtitan's default) writes it in every save.
        mgr = manager(cfg, pre_finalize_callback=pre_finalize)
        try:
            mgr.save(f"{FOLDER}/step-{step}", {"model": m.state_dict(),
                                               "optimizer": opt.state_dict(),
                                               "trainer": {"step": step}})
        finally:
            mgr.close()


def newest_step(st: Storage) -> int:
    """torchtitan's step discovery (BaseCheckpointManager._find_load_step with
    TorchCheckpointingManager._is_valid_checkpoint): ``step-N`` directories holding
    ``metadata.pkl`` as a file."""
    if not st.isdir(Path(FOLDER)):
        return -1
    steps = []
    for name in st.ls(Path(FOLDER)):
        match = re.fullmatch(r"step-(\d+)", name)
        probe = Path(FOLDER, name, "metadata.pkl")
        if match and st.exists(probe) and not st.isdir(probe):
            steps.append(int(match.group(1)))
    return max(steps, default=-1)


def fresh() -> tuple[Tiny, Any]:
    m = model(0)
    return m, torch.optim.AdamW(m.parameters(), lr=0.1)


def reference(upto: int) -> dict[str, Any]:
    m, opt = fresh()
    for step in range(1, upto + 1):
        train_step(m, opt, step)
    return {"model": m.state_dict(), "optimizer": opt.state_dict()}


def resume(cfg: CkptfsStorageConfig) -> tuple[int, Tiny, Any]:
    st = cfg.create_storage()
    step = newest_step(st)
    m, opt = fresh()
    mgr = manager(cfg)
    try:
        out = mgr.load(f"{FOLDER}/step-{step}", into={"model": m.state_dict(),
                                                      "optimizer": None, "trainer": None})
    finally:
        mgr.close()
    opt.load_state_dict(out["optimizer"])
    assert out["trainer"] == {"step": step}
    return step, m, opt


def assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert set(a) == set(b)
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


def check_loop(backend: Backend, cfg: CkptfsStorageConfig, die: str) -> None:
    st = cfg.create_storage()
    assert newest_step(st) == KILL_AT - 1
    names = st.ls(Path(FOLDER))
    assert f"step-{KILL_AT}" not in names and f"tmp_step-{KILL_AT}" in names  # uncommitted
    assert "tmp_step-1" not in names  # committed sources are hidden
    step, m, opt = resume(cfg)
    assert step == KILL_AT - 1
    want = reference(step)
    assert_same(m.state_dict(), want["model"])
    assert_same(opt.state_dict(), want["optimizer"])
    # carry on to the end (re-saving the step that died over its leftover staging directory)
    run_training(cfg, step, m, opt, None, die)
    assert newest_step(st) == STEPS
    step, m, opt = resume(cfg)
    want = reference(STEPS)
    assert_same(m.state_dict(), want["model"])
    assert_same(opt.state_dict(), want["optimizer"])


def test_kill_mid_save_memory_resumes_newest_committed(memory_backend: Backend) -> None:
    cfg = config(memory_backend)
    m, opt = fresh()
    with pytest.raises(RuntimeError, match="simulated crash"):
        run_training(cfg, 0, m, opt, KILL_AT, "raise")
    check_loop(memory_backend, cfg, "raise")


def kill_loop(backend: Backend) -> None:
    job = {"url": backend.url, "options": dict(backend.options)}
    proc = subprocess.run([sys.executable, __file__, json.dumps(job)],
                          env={**os.environ, **backend.env}, capture_output=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    check_loop(backend, config(backend), "kill")


def test_sigkill_mid_save_resumes_newest_committed_local(local_backend: Backend) -> None:
    kill_loop(local_backend)


def test_sigkill_mid_save_resumes_newest_committed_s3(s3_backend: Backend,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    for key, value in s3_backend.env.items():
        monkeypatch.setenv(key, value)
    kill_loop(s3_backend)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gcs", "azure"])
def test_sigkill_mid_save_resumes_newest_committed_slow(
        name: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    b: Backend = request.getfixturevalue(f"{name}_backend")
    for key, value in b.env.items():
        monkeypatch.setenv(key, value)
    kill_loop(b)


def test_async_saver_builds_the_storage_in_its_subprocess(local_backend: Backend) -> None:
    """torchtitan's default saver: the config goes to its writer subprocess (pickled), which
    writes and commits there; metadata.pkl is in every save, so discovery sees each step."""
    cfg = config(local_backend)
    m, opt = fresh()
    mgr = CheckpointManager.Config(items={"model": ItemSpec(resharder=DefaultResharder())},
                                   save=AsyncCheckpointSaverConfig(), storage_config=cfg).build()
    try:
        for step in (1, 2):
            train_step(m, opt, step)
            mgr.save(f"{FOLDER}/step-{step}",
                     {"model": m.state_dict(), "trainer": {"step": step}}).result(timeout=120)
    finally:
        mgr.close()
    st = cfg.create_storage()
    assert newest_step(st) == 2 and st.ls(Path(FOLDER)) == ["step-1", "step-2"]
    rec = st.committed(Path(FOLDER, "step-2"))
    assert rec is not None and {"metadata.pkl", "model_0.pt"} <= set(rec.files)
    target = model(7)
    mgr = manager(cfg)
    try:
        mgr.load(f"{FOLDER}/step-2", into={"model": target.state_dict(), "trainer": None})
    finally:
        mgr.close()
    assert_same(target.state_dict(), m.state_dict())


def test_missing_package_names_the_extra() -> None:
    code = ("import sys; sys.modules['torch_checkpointing'] = None\n"
            "try:\n    import ckptfs.torch_checkpointing\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert 'pip install "ckptfs[torch-checkpointing]"' in out.stdout, out.stderr


def test_storage_is_a_torch_checkpointing_storage(memory_backend: Backend) -> None:
    st = config(memory_backend).create_storage()
    assert isinstance(st, Storage) and isinstance(st, CkptfsStorage)
    assert st.mmap_fill_chunk_bytes is not None and st.mmap_fill_chunk_bytes % st.block_size == 0


if __name__ == "__main__":
    job = json.loads(sys.argv[1])
    m0, opt0 = fresh()
    run_training(CkptfsStorageConfig(url=job["url"], storage_options=job["options"]), 0, m0, opt0,
                 KILL_AT, "kill")
    sys.exit(3)  # not reached: the job is killed inside the save of KILL_AT
