"""Bad input gets a typed error that names the path and says what to do (issue: core)."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import ckptfs
from ckptfs.errors import (
    BackendUnavailableError,
    CheckpointNotFoundError,
    CkptfsError,
    FormatVersionError,
    HashAlgorithmUnavailableError,
    InvalidStepError,
)
from ckptfs.format.layout import StepPaths
from ckptfs.testing.backend import Backend


def test_error_hierarchy_refines_builtins() -> None:
    assert issubclass(ckptfs.CheckpointNotFoundError, FileNotFoundError)
    assert issubclass(ckptfs.CheckpointExistsError, FileExistsError)
    assert issubclass(ckptfs.CorruptCheckpointError, ValueError)
    assert issubclass(ckptfs.UnsupportedValueError, TypeError)
    assert issubclass(ckptfs.InvalidStepError, ValueError)
    assert issubclass(ckptfs.StorageError, OSError)
    assert issubclass(ckptfs.BackendUnavailableError, ImportError)
    for name in ckptfs.__all__:
        obj = getattr(ckptfs, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, CkptfsError), name


def test_unknown_protocol_names_known_ones() -> None:
    with pytest.raises(BackendUnavailableError) as ei:
        ckptfs.open("nosuchproto://bucket/x")
    assert "nosuchproto" in str(ei.value) and "s3" in str(ei.value)


def test_missing_package_named() -> None:
    with pytest.raises(BackendUnavailableError) as ei:
        ckptfs.open("hdfs://namenode/x")  # pyarrow is not a dependency
    assert "pyarrow" in str(ei.value)
    assert "hdfs://namenode/x" in str(ei.value)


def test_unknown_hash_algorithm() -> None:
    with pytest.raises(HashAlgorithmUnavailableError, match="md5"):
        ckptfs.open("memory://x", algorithm="md5")


@pytest.mark.parametrize("step", [-1, 10**12, 2.0, "5", None, True])
def test_invalid_steps(memory_backend: Backend, step: object) -> None:
    store = memory_backend.open()
    with pytest.raises(InvalidStepError):
        store.save(step, {"a": 1})  # type: ignore[arg-type]
    if step is not None:  # load(None) means "latest"
        with pytest.raises(InvalidStepError):
            store.load(step)  # type: ignore[arg-type]


def test_load_uncommitted_lists_what_exists(local_backend: Backend) -> None:
    store = local_backend.open()
    store.save(100, {"a": torch.zeros(1)})
    store.save(200, {"a": torch.zeros(1)})
    local_backend.raw_write(f"{StepPaths(300).dir}/a-20200101T000000Z-00000000aaaaaaaa/x", b"1")
    with pytest.raises(CheckpointNotFoundError) as ei:
        store.load(300)
    msg = str(ei.value)
    assert "step 300 is not committed" in msg and "100, 200" in msg
    assert local_backend.url in msg


def test_newer_format_version_is_refused(memory_backend: Backend) -> None:
    store = memory_backend.open()
    store.save(1, {"a": 1})
    marker = json.loads(memory_backend.raw_read(StepPaths(1).marker))
    marker["format_version"] = 2
    memory_backend.raw_write(StepPaths(1).marker, json.dumps(marker).encode())
    with pytest.raises(FormatVersionError, match="upgrade ckptfs"):
        memory_backend.open().latest()


def test_metadata_must_be_json(memory_backend: Backend) -> None:
    with pytest.raises(ckptfs.UnsupportedValueError, match="metadata"):
        memory_backend.open().save(1, {"a": 1}, metadata={"x": object()})
    assert memory_backend.raw_files() == {}


def test_storage_failure_is_wrapped(tmp_path, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = ckptfs.open(str(blocker))
    with caplog.at_level(logging.WARNING), pytest.raises(ckptfs.StorageError) as ei:
        store.save(1, {"a": torch.zeros(1)})
    assert str(blocker) in str(ei.value)
    assert ei.value.__cause__ is not None
