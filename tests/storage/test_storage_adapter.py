"""The storage adapter's own logic: the capability table (and its copy in docs/backends.md),
option merging, the gcsfs class trap, the warning for backends without exclusive create, and
412 detection: every library's shape of "precondition failed" is recognised (from the real
servers and as constructed exceptions) and nothing else is mistaken for "exists"."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import fsspec
import pytest
from fsspec.implementations.memory import MemoryFileSystem

import ckptfs
from ckptfs.errors import (
    CheckpointExistsError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
)
from ckptfs.storage.backends import BACKENDS, S3_CONFIG, capability_table, merge_options, spec_for
from ckptfs.storage.base import (
    OPTIONAL_CAPABILITIES,
    BatchedSync,
    CapabilityUnavailableError,
    EmptyDirRemoval,
    LocalFiles,
    ModifiedTimes,
    MultipartUploads,
    RangedRead,
    ServerChecksums,
    supports,
)
from ckptfs.storage.fsspec import (
    FsspecStorage,
    classify,
    describe_cause,
    has_multipart_api,
    is_precondition_failure,
)
from ckptfs.testing.backend import Backend
from ckptfs.testing.conformance import assert_state_equal, small_state
from ckptfs.testing.servers import ServerInfo

DOCS = Path(__file__).resolve().parents[2] / "docs" / "backends.md"


class PlainMemoryFS(MemoryFileSystem):  # type: ignore[misc]
    """A filesystem ckptfs has no table entry for (so: no exclusive create)."""

    protocol = ("ckptfs-plainmem",)


fsspec.register_implementation("ckptfs-plainmem", PlainMemoryFS, clobber=True)


# -- the table ---------------------------------------------------------------------------------


def test_docs_carry_the_capability_table() -> None:
    assert capability_table() in DOCS.read_text(), (
        "docs/backends.md is out of step with ckptfs/storage/backends.py: paste "
        "capability_table() into it")


def test_table_is_complete_and_consistent() -> None:
    for name, spec in BACKENDS.items():
        caps = spec.capabilities
        assert spec.exclusive_how and spec.listing_cache and spec.abort, name
        if caps.exclusive_create == "server_precondition":
            assert spec.probe_on_open and spec.min_block_size, name
            assert spec.default_options["use_listings_cache"] is False, name
            assert spec.default_options["skip_instance_cache"] is True, name
        assert not caps.atomic_rename or caps.real_directories, name
    assert BACKENDS["s3"].capabilities.empty_create_safe is False  # the s3fs touch() trap


def test_unknown_protocol_is_conservative() -> None:
    spec = spec_for("ckptfs-plainmem")
    assert spec.capabilities.exclusive_create == "none"
    assert not spec.capabilities.exclusive_across_processes
    assert "both 'commit'" in spec.caveat


@pytest.mark.parametrize("name,offered", [
    ("local", {RangedRead, LocalFiles, EmptyDirRemoval, ModifiedTimes, BatchedSync}),
    ("memory", {RangedRead, ModifiedTimes}),
    ("s3", {RangedRead, ModifiedTimes, MultipartUploads, ServerChecksums}),
])
def test_adapter_offers_its_optional_capabilities(request: pytest.FixtureRequest, name: str,
                                                  offered: set[type]) -> None:
    """``offers()`` is decided per backend, as data; an optional member the backend lacks is
    refused with a typed error instead of half-working."""
    b: Backend = request.getfixturevalue(f"{name}_backend")
    st = FsspecStorage(b.url, **b.options)
    assert {c for c in OPTIONAL_CAPABILITIES if supports(st, c)} == offered
    if LocalFiles not in offered:
        with pytest.raises(CapabilityUnavailableError):
            st.local_path("x")
    if MultipartUploads not in offered:
        with pytest.raises(CapabilityUnavailableError):
            st.list_uploads("")


def test_multipart_uploads_follow_the_filesystem_not_the_url() -> None:
    """The capability is what the filesystem object can do (s3fs lists and aborts uploads),
    whatever protocol name the URL used."""
    import s3fs

    st = FsspecStorage(f"memory://mp-{uuid.uuid4().hex[:8]}")
    assert not supports(st, MultipartUploads)
    assert has_multipart_api(s3fs.S3FileSystem(anon=True, skip_instance_cache=True))
    assert not has_multipart_api(MemoryFileSystem())


def test_modified_times_are_aware_and_none_when_absent(tmp_path: Path) -> None:
    st = FsspecStorage(str(tmp_path / "run"))
    st.write_bytes("a/b.bin", b"x")
    os.utime(tmp_path / "run" / "a" / "b.bin", (1_700_000_000, 1_700_000_000))
    assert st.modified("a/b.bin") == datetime.fromtimestamp(1_700_000_000, timezone.utc)
    assert st.modified("a/missing.bin") is None


def test_remove_empty_dir_never_removes_content(tmp_path: Path) -> None:
    st = FsspecStorage(str(tmp_path / "run"))
    st.write_bytes("d/f.bin", b"x")
    st.makedirs("e")
    assert st.remove_empty_dir("d") is False and st.exists("d/f.bin")
    assert st.remove_empty_dir("e") is True and not (tmp_path / "run" / "e").exists()
    with pytest.raises(StorageNotFoundError):
        st.remove_empty_dir("e")


def test_merge_options_user_wins_and_dicts_merge() -> None:
    merged = merge_options(BACKENDS["s3"].default_options,
                           {"config_kwargs": {"connect_timeout": 1}, "use_listings_cache": True})
    assert merged["use_listings_cache"] is True
    assert merged["config_kwargs"]["connect_timeout"] == 1
    assert merged["config_kwargs"]["retries"] == S3_CONFIG["retries"]
    assert BACKENDS["s3"].default_options["config_kwargs"]["connect_timeout"] == 10


# -- the warning for a backend without exclusive create ------------------------------------------


def test_no_exclusive_create_warns_once_per_store(caplog: pytest.LogCaptureFixture) -> None:
    url = f"ckptfs-plainmem://{uuid.uuid4().hex}"
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        store = ckptfs.open(url)
        store.save(1, small_state(1))
        store.save(2, small_state(2))
        assert store.steps() == [1, 2]
        assert_state_equal(store.load(), small_state(2))
        store.verify(2)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert url in warnings[0].getMessage() and "both 'commit'" in warnings[0].getMessage()
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        ckptfs.open(url)
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 2


def test_backends_with_exclusive_create_do_not_warn(caplog: pytest.LogCaptureFixture,
                                                   tmp_path: Path) -> None:
    with caplog.at_level(logging.WARNING, logger="ckptfs"):
        ckptfs.open(str(tmp_path / "run")).save(1, small_state())
        ckptfs.open(f"memory://{uuid.uuid4().hex}").save(1, small_state())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


# -- gcsfs: the experimental class is never used against an endpoint -----------------------------


def test_gcs_endpoint_works_whatever_gcsfs_env(fake_gcs: ServerInfo) -> None:
    """In a fresh process with GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=true (gcsfs's default), gcsfs
    would pick its experimental class, whose every call stalls 40-100 s on an emulator; ckptfs
    must use the plain class and work at once, without the user knowing."""
    fake_gcs.reset()
    code = (
        "import json, sys, gcsfs, ckptfs\n"
        "opts = json.loads(sys.argv[2])\n"
        "store = ckptfs.open(sys.argv[1], **opts)\n"
        "store.save(3, {'x': [1, 2, 3]})\n"
        "fs = store.storage.inner.fs\n"
        "print(json.dumps({'cls': type(fs).__module__ + '.' + type(fs).__name__,\n"
        "                  'default': gcsfs.GCSFileSystem.__name__,\n"
        "                  'steps': ckptfs.open(sys.argv[1], **opts).steps()}))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "STORAGE_EMULATOR_HOST"}
    env["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] = "true"
    proc = subprocess.run(
        [sys.executable, "-c", code, fake_gcs.url("trap"), json.dumps(fake_gcs.storage_options)],
        env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["default"] == "ExtendedGcsFileSystem"  # the trap is armed in that process
    assert out["cls"] == "gcsfs.core.GCSFileSystem"
    assert out["steps"] == [3]


# -- 412 detection: real servers ---------------------------------------------------------------


def _second_create_error(info: ServerInfo) -> BaseException:
    info.reset()
    fs = info.filesystem()
    path = f"{info.bucket}/m/{uuid.uuid4().hex}"
    fs.pipe_file(path, b"first", mode="create")
    with pytest.raises(Exception) as ei:
        fs.pipe_file(path, b"second", mode="create")
    assert fs.cat_file(path) == b"first"
    return ei.value


def test_moto_412_is_file_exists(moto: ServerInfo) -> None:
    exc = _second_create_error(moto)
    assert isinstance(exc, FileExistsError)
    assert is_precondition_failure(exc)


def test_ministack_412_is_oserror_einval_and_recognised(ministack: ServerInfo) -> None:
    """ministack's 412 has no Condition element, so s3fs raises OSError(EINVAL), which alone
    would not say "exists": ckptfs finds the 412 in the exception chain."""
    exc = _second_create_error(ministack)
    assert type(exc) is OSError and exc.errno == errno.EINVAL
    assert not isinstance(exc, FileExistsError)
    assert is_precondition_failure(exc)


def test_gcsfs_412_recognised(fake_gcs: ServerInfo) -> None:
    exc = _second_create_error(fake_gcs)
    assert isinstance(exc, FileExistsError)
    assert is_precondition_failure(exc)


def test_adlfs_exists_recognised(azurite: ServerInfo) -> None:
    exc = _second_create_error(azurite)
    assert isinstance(exc, FileExistsError)
    assert type(exc.__cause__ or exc.__context__).__name__ == "ResourceExistsError"
    assert is_precondition_failure(exc)


@pytest.mark.parametrize("name", ["moto", "ministack", "fake_gcs", "azurite"])
def test_adapter_create_exists_is_typed(request: pytest.FixtureRequest, name: str) -> None:
    info: ServerInfo = request.getfixturevalue(name)
    info.reset()
    st = FsspecStorage(info.url("adapter"), **info.storage_options)
    st.create_exclusive("m/COMPLETE", b"one")
    with pytest.raises(CheckpointExistsError) as ei:
        st.create_exclusive("m/COMPLETE", b"two")
    assert info.url("adapter") in str(ei.value)


@pytest.mark.parametrize("name", ["moto", "ministack", "fake_gcs", "azurite"])
def test_real_non_412_is_not_exists(request: pytest.FixtureRequest, name: str) -> None:
    """A create-only write that fails for another reason (missing bucket) is a storage error,
    never "another writer committed"."""
    info: ServerInfo = request.getfixturevalue(name)
    fs = info.filesystem()
    with pytest.raises(Exception) as ei:
        fs.pipe_file("no-such-bucket-ckptfs/m/COMPLETE", b"x", mode="create")
    assert not is_precondition_failure(ei.value)
    st = FsspecStorage(f"{info.protocol}://no-such-bucket-ckptfs/run", probe=False,
                       **info.storage_options)
    with pytest.raises(StorageError) as ei2:
        st.create_exclusive("m/COMPLETE", b"x")
    assert not isinstance(ei2.value, CheckpointExistsError)
    assert isinstance(ei2.value, StorageNotFoundError)


# -- 412 detection: each library's shape, constructed ---------------------------------------


def _client_error(status: int, code: str, op: str = "PutObject") -> Exception:
    from botocore.exceptions import ClientError

    exc: Exception = ClientError({"Error": {"Code": code, "Message": "m"},
                                  "ResponseMetadata": {"HTTPStatusCode": status}}, op)
    return exc


def _wrapped(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


def _azure(status: int, code: str, cls_name: str = "HttpResponseError") -> Exception:
    import azure.core.exceptions as az

    exc: Any = getattr(az, cls_name)(message=f"{code} happened")
    exc.status_code = status
    exc.error_code = code
    return exc  # type: ignore[no-any-return]


def _gcs(status: int, message: str) -> Exception:
    from gcsfs.retry import HttpError

    exc: Exception = HttpError({"code": status, "message": message})
    return exc


PRECONDITION_SHAPES: dict[str, Callable[[], BaseException]] = {
    "s3fs FileExistsError": lambda: _wrapped(FileExistsError("x"),
                                             _client_error(412, "PreconditionFailed")),
    "s3fs OSError(EINVAL) over 412 (ministack)": lambda: _wrapped(
        OSError(errno.EINVAL, "At least one of the pre-conditions you specified did not hold"),
        _client_error(412, "PreconditionFailed")),
    "s3fs OSError(EINVAL) over bare 412": lambda: _wrapped(
        OSError(errno.EINVAL, "x"), _client_error(412, "412")),
    "gcsfs FileExistsError": lambda: FileExistsError("http://h/upload/storage/v1/b/b/o"),
    "gcsfs HttpError 412": lambda: _gcs(412, "Precondition Failed"),
    "adlfs FileExistsError over ResourceExistsError": lambda: _wrapped(
        FileExistsError("m"), _azure(409, "BlobAlreadyExists", "ResourceExistsError")),
    "azure ResourceModifiedError 412 ConditionNotMet": lambda: _azure(
        412, "ConditionNotMet", "ResourceModifiedError"),
    "azure HttpResponseError 409 BlobAlreadyExists": lambda: _azure(409, "BlobAlreadyExists"),
}

NOT_PRECONDITION_SHAPES: dict[str, Callable[[], BaseException]] = {
    "s3fs OSError(EINVAL) over 400 InvalidArgument": lambda: _wrapped(
        OSError(errno.EINVAL, "Invalid argument"), _client_error(400, "InvalidArgument")),
    "s3 403 AccessDenied": lambda: _wrapped(PermissionError("Access Denied"),
                                            _client_error(403, "AccessDenied")),
    "s3 500 InternalError": lambda: _wrapped(OSError("boom"), _client_error(500, "InternalError")),
    "s3 404 NoSuchBucket": lambda: _wrapped(FileNotFoundError("b"),
                                            _client_error(404, "NoSuchBucket")),
    "gcsfs HttpError 503": lambda: _gcs(503, "Backend Error"),
    "gcsfs Forbidden": lambda: OSError("Forbidden: b/x\nno access"),
    "azure 409 LeaseIdMissing": lambda: _azure(409, "LeaseIdMissing"),
    "azure 403 AuthorizationFailure": lambda: _azure(403, "AuthorizationFailure"),
    "timeout": lambda: TimeoutError("read timed out"),
    "connection refused": lambda: ConnectionRefusedError(errno.ECONNREFUSED, "refused"),
    "OSError errno 412 but not HTTP": lambda: OSError(412, "odd errno"),
}


@pytest.mark.parametrize("shape", sorted(PRECONDITION_SHAPES))
def test_precondition_shapes_recognised(shape: str) -> None:
    assert is_precondition_failure(PRECONDITION_SHAPES[shape]())


@pytest.mark.parametrize("shape", sorted(NOT_PRECONDITION_SHAPES))
def test_other_errors_not_mistaken_for_exists(shape: str) -> None:
    assert not is_precondition_failure(NOT_PRECONDITION_SHAPES[shape]())


def _credential_errors() -> dict[str, BaseException]:
    import azure.identity
    import botocore.exceptions as boto
    import google.auth.exceptions as gauth

    return {
        "botocore NoCredentialsError": boto.NoCredentialsError(),
        "botocore PartialCredentialsError": boto.PartialCredentialsError(
            provider="env", cred_var="AWS_SECRET_ACCESS_KEY"),
        "botocore NoCredentialsError under s3fs's OSError": _wrapped(
            OSError("Unable to locate credentials"), boto.NoCredentialsError()),
        "google-auth DefaultCredentialsError": gauth.DefaultCredentialsError("none found"),
        "google-auth RefreshError": gauth.RefreshError("invalid_grant"),
        "azure-identity CredentialUnavailableError":
            azure.identity.CredentialUnavailableError(message="no credential"),
    }


def test_missing_or_refused_credentials_are_access_errors() -> None:
    """Missing credentials (no key, no profile, no metadata service) are the configuration,
    not an outage: `StorageAccessError`, which the retry layer and the replicator never
    retry.  A refresh error its library marks retryable stays a plain storage error."""
    from google.auth.exceptions import RefreshError

    from ckptfs.storage.retry import is_retryable

    for name, exc in _credential_errors().items():
        assert classify(exc) is StorageAccessError, name
        assert not is_retryable(StorageAccessError(str(exc))), name
    assert classify(RefreshError("503 from the token endpoint", retryable=True)) is StorageError


def test_classify_and_describe() -> None:
    assert classify(NOT_PRECONDITION_SHAPES["s3 403 AccessDenied"]()) is StorageAccessError
    assert classify(NOT_PRECONDITION_SHAPES["azure 403 AuthorizationFailure"]()) \
        is StorageAccessError
    assert classify(NOT_PRECONDITION_SHAPES["gcsfs Forbidden"]()) is StorageAccessError
    assert classify(NOT_PRECONDITION_SHAPES["s3 404 NoSuchBucket"]()) is StorageNotFoundError
    assert classify(_azure(404, "ContainerNotFound", "ResourceNotFoundError")) \
        is StorageNotFoundError
    assert classify(NOT_PRECONDITION_SHAPES["timeout"]()) is StorageError
    text = describe_cause(NOT_PRECONDITION_SHAPES["s3 500 InternalError"]())
    assert "InternalError" in text and "HTTP 500" in text
