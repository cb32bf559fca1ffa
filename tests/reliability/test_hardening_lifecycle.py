"""Hardening, lifecycle and CLI: metrics of every real scalar type, non-finite metrics, the
save's bookkeeping after the commit, rollback in ``restore_latest``, retention that keeps the
fallbacks of a damaged newest checkpoint, GC that aborts only ckptfs's multipart uploads,
hostile lifecycle content, concurrent gc/prune, and CLI usage errors (local and memory; S3 on
moto for the multipart uploads)."""

from __future__ import annotations

import json
import re
import threading
from datetime import datetime, timedelta, timezone
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch

import ckptfs
from ckptfs.cli.core import main
from ckptfs.errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    ProvenanceMismatchError,
    RngStateError,
    StorageError,
    StorageNotFoundError,
    UnsupportedValueError,
)
from ckptfs.format.layout import StepPaths, new_attempt_name
from ckptfs.lifecycle import rng
from ckptfs.lifecycle.gc import InvalidDurationError, collect, parse_duration
from ckptfs.lifecycle.records import CorruptRecordError, RecordLog
from ckptfs.lifecycle.retention import Best, RetentionPolicy, metric_value, prune, read_best
from ckptfs.testing.backend import Backend

HOUR = timedelta(hours=1)


@pytest.fixture(params=["local", "memory"])
def backend(request: pytest.FixtureRequest) -> Backend:
    return request.getfixturevalue(f"{request.param}_backend")  # type: ignore[no-any-return]


def manager(backend: Backend, **kw: Any) -> ckptfs.CheckpointManager:
    return ckptfs.CheckpointManager(backend.open(), rank=0, world_size=1, **kw)


def tensor_file(backend: Backend, step: int) -> str:
    info = backend.open().info(step)
    return next(f"{info.path}/{e.path}" for e in info.manifest.files
                if e.path.endswith(".safetensors"))


def truncate(backend: Backend, step: int) -> None:
    path = tensor_file(backend, step)
    backend.raw_write(path, backend.raw_read(path)[:10])


def flip_bytes(backend: Backend, step: int) -> None:
    """Same size, different content: only a full (hashing) read sees it."""
    path = tensor_file(backend, step)
    data = bytearray(backend.raw_read(path))
    data[-1] ^= 0xFF
    data[-9] ^= 0xFF
    backend.raw_write(path, bytes(data))


# -- defect 4: metrics of every real scalar type ------------------------------------------------


@pytest.mark.parametrize("value", [
    torch.tensor(0.25), torch.tensor([0.25]), torch.tensor(1, dtype=torch.int64),
    np.float32(0.25), np.float64(0.25), np.array(0.25), np.int64(1), Decimal("0.25"),
    Fraction(1, 4), 1, 0.25])
def test_best_tracks_every_real_scalar(backend: Backend, value: object) -> None:
    mgr = manager(backend, keep_last=1, best=Best("loss", "min"))
    mgr.save(1, metrics={"loss": value})
    mgr.save(2, metrics={"loss": 5.0})  # worse: the best must survive keep_last=1
    best = mgr.best()
    assert best is not None and best["step"] == 1
    assert best["value"] == pytest.approx(float(value))  # type: ignore[arg-type]
    assert backend.open().steps() == [1, 2]
    assert backend.open().info(1).metadata["metrics"]["loss"] == best["value"]


@pytest.mark.parametrize("value", [
    torch.tensor([0.1, 0.2]), torch.tensor(True), torch.tensor(1 + 2j), np.array([1.0, 2.0]),
    np.complex128(1 + 1j), np.bool_(True), 1 + 2j, "0.5", True, b"1", [0.5], 10 ** 400])
def test_bad_tracked_metric_refused_before_commit(backend: Backend, value: object) -> None:
    mgr = manager(backend, keep_last=1, best=Best("loss", "min"))
    with pytest.raises(UnsupportedValueError, match="metric 'loss'"):
        mgr.save(1, metrics={"loss": value})
    assert backend.open().steps() == []
    assert mgr.save(1, metrics={"loss": 0.5}).best_improved  # the manager is still usable


def test_other_metrics_normalized_or_refused(backend: Backend) -> None:
    mgr = manager(backend)
    mgr.save(1, metrics={"acc": np.float32(0.5), "ok": np.bool_(True), "tag": "x",
                         "n": torch.tensor(3)})
    assert backend.open().info(1).metadata["metrics"] == {"acc": 0.5, "ok": True, "tag": "x",
                                                          "n": 3.0}
    with pytest.raises(UnsupportedValueError, match="metric 'hist'"):
        mgr.save(2, metrics={"hist": torch.zeros(3)})
    with pytest.raises(UnsupportedValueError, match="mapping"):
        mgr.save(2, metrics=[("loss", 1.0)])  # type: ignore[arg-type]
    assert backend.open().steps() == [1]


def test_metric_value_contract() -> None:
    assert metric_value(None) is None
    assert metric_value(np.float16(0.5)) == 0.5
    assert metric_value(float("inf")) == float("inf")  # the caller decides about inf/NaN
    with pytest.raises(UnsupportedValueError):
        metric_value(np.str_("1"))


# -- defect 5: NaN and infinite metrics -----------------------------------------------------------


@pytest.mark.parametrize("mode", ["min", "max"])
def test_non_finite_metric_save_commits_prunes_and_never_enters_pool(
        backend: Backend, mode: str, caplog: pytest.LogCaptureFixture) -> None:
    mgr = manager(backend, keep_last=1, best=Best("loss", mode))  # type: ignore[arg-type]
    mgr.save(1, metrics={"loss": 1.0})
    for step, bad in ((2, float("inf")), (3, float("-inf")), (4, float("nan")),
                      (5, torch.tensor(float("inf"))), (6, np.float32("inf"))):
        result = mgr.save(step, metrics={"loss": bad})
        assert result.info is not None and not result.best_improved and not result.errors
        assert result.prune is not None
        assert result.prune.deleted == ([] if step == 2 else [step - 1])
    assert "not finite" in caplog.text
    assert backend.open().steps() == [1, 6]  # best 1, newest 6: everything else pruned
    assert mgr.best() == {"step": 1, "value": 1.0}
    assert backend.open().info(6).metadata["metrics"] == {"loss": None}
    doc = read_best(backend.open())
    assert doc is not None and doc["high_water"] == 1.0
    json.dumps(doc, allow_nan=False)
    better = 0.5 if mode == "min" else 2.0
    assert mgr.save(7, metrics={"loss": better}).best_improved
    resumed = manager(backend, keep_last=1, best=Best("loss", mode))  # type: ignore[arg-type]
    assert resumed.restore_latest() == 8 and resumed.best() == {"step": 7, "value": better}


def test_bookkeeping_failure_after_commit_reported_not_raised(
        backend: Backend, monkeypatch: pytest.MonkeyPatch) -> None:
    mgr = manager(backend, keep_last=1, best=Best("loss", "min"))
    mgr.save(1, metrics={"loss": 2.0})

    def broken(*_a: Any, **_k: Any) -> None:
        raise StorageError("injected: the store refused the record")

    monkeypatch.setattr(mgr, "_persist_best", broken)
    monkeypatch.setattr(mgr.side_outputs, "committed", broken)
    result = mgr.save(2, metrics={"loss": 1.0})
    assert result.info is not None and result.best_improved
    assert [e.split(":")[0] for e in result.errors] == ["side-output record", "best record"]
    assert result.prune is not None and result.prune.deleted == [1]  # the prune still ran
    assert backend.open().steps() == [2]


# -- defect 8: restore_latest(allow_rollback=True) past corrupt data ------------------------------


def test_restore_latest_rolls_back_past_corrupt_data(backend: Backend) -> None:
    mgr = manager(backend)
    models = {s: torch.nn.Linear(2, 2) for s in (1, 2, 3)}
    for s, m in models.items():
        mgr.save(s, model=m)
    flip_bytes(backend, 3)
    target = torch.nn.Linear(2, 2)
    with pytest.raises(CorruptCheckpointError, match="step 3") as ei:
        manager(backend).restore_latest(model=target)
    assert "allow_rollback" in str(ei.value)
    assert not torch.equal(target.weight, models[3].weight)
    assert manager(backend).restore_latest(model=target, allow_rollback=True) == 3
    assert torch.equal(target.weight, models[2].weight)
    flip_bytes(backend, 2)
    flip_bytes(backend, 1)
    with pytest.raises(CheckpointNotFoundError, match="every one is corrupt"):
        manager(backend).restore_latest(model=target, allow_rollback=True)


# -- defect 10: retention keeps the fallbacks of a damaged newest checkpoint --------------------


def test_prune_refuses_while_newest_fails_quick_verify(
        backend: Backend, capsys: pytest.CaptureFixture[str]) -> None:
    mgr = manager(backend)
    for s in (1, 2, 3):
        mgr.save(s, model=torch.nn.Linear(2, 2))
    truncate(backend, 3)
    report = prune(backend.open(), RetentionPolicy(keep_last=1))
    assert report.refused and "step 3" in report.refused and report.deleted == []
    assert main(["prune", backend.url, "--keep-last", "1"]) == 1
    out = capsys.readouterr().out
    assert "REFUSED" in out and "quick verify" in out
    assert main(["prune", backend.url, "--keep-last", "1", "--dry-run", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["refused"]
    auto = manager(backend, keep_last=1)
    assert auto.prune().refused
    assert backend.open().steps() == [1, 2, 3]
    backend.open().delete(3)  # the damaged one removed by hand: pruning works again
    assert main(["prune", backend.url, "--keep-last", "1"]) == 0
    assert backend.open().steps() == [2]


def test_manager_prune_after_save_refuses_when_newest_damaged(backend: Backend) -> None:
    """The manager's own prune checks the newest listed checkpoint, which need not be the one
    it just wrote (another writer committed a later one)."""
    mgr = manager(backend, keep_last=1)
    mgr.save(1)
    mgr.save(2)
    backend.open().save(9, {"x": torch.ones(4)})  # another writer, later step
    truncate(backend, 9)
    result = mgr.save(3)
    assert result.info is not None and result.prune is not None and result.prune.refused
    assert any("prune refused" in e for e in result.errors)
    assert backend.open().steps() == [2, 3, 9]


# -- defect 7: GC aborts only ckptfs's multipart uploads ------------------------------------------


def _start_upload(fs: Any, bucket: str, key: str) -> str:
    up = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=key)
    fs.call_s3("upload_part", Bucket=bucket, Key=key, UploadId=up["UploadId"], PartNumber=1,
               Body=b"p" * (5 * 1024 * 1024))
    return str(up["UploadId"])


@pytest.mark.parametrize("at_bucket_root", [False, True])
def test_gc_aborts_only_attempt_uploads(s3_backend: Backend, at_bucket_root: bool) -> None:
    url = s3_backend.url
    if at_bucket_root:
        url = url.rsplit("/", 1)[0]
    store = ckptfs.open(url, **s3_backend.options)
    fs = store.storage.inner.fs  # type: ignore[attr-defined]
    bucket, key, _ = fs.split_path(store.storage.inner.root)  # type: ignore[attr-defined]
    base = f"{key}/" if key else ""
    old = new_attempt_name(datetime.now(timezone.utc) - 3 * HOUR)
    ours = {
        _start_upload(fs, bucket, f"{base}checkpoints/step-000000000001/{old}/t.safetensors"),
        _start_upload(fs, bucket, f"{base}artifacts/ref/checkpoints/step-000000000000/.tmp-{old}"
                                  "/t.safetensors")}
    foreign = {
        _start_upload(fs, bucket, f"{base}exports/model.bin"),
        _start_upload(fs, bucket, f"{base}checkpoints/notes/{old}/x.bin"),
        _start_upload(fs, bucket, f"{base}checkpoints/step-000000000001/exports/big.bin"),
        _start_upload(fs, bucket, f"{base}checkpoints/step-000000000001/{old}"),
        _start_upload(fs, bucket, "elsewhere/object.bin")}
    report = collect(store.storage, older_than=HOUR, now=datetime.now(timezone.utc) + 2 * HOUR)
    aborted = {i.path.rsplit("#", 1)[1] for i in report.items if i.kind == "multipart"}
    assert aborted == ours and all(i.removed for i in report.items if i.kind == "multipart")
    left = {u["UploadId"] for u in fs.list_multipart_uploads(bucket)}
    assert foreign <= left and not ours & left
    for upload in foreign:  # leave the bucket as found
        for u in fs.list_multipart_uploads(bucket):
            if u["UploadId"] == upload:
                fs.call_s3("abort_multipart_upload", Bucket=bucket, Key=u["Key"],
                           UploadId=upload)


# -- hostile lifecycle content ------------------------------------------------------------------


@pytest.mark.parametrize("doc", [
    b'{"schema": "ckptfs.best", "version": 1, "metric": "loss", "mode": "min", "pool": "1"}',
    b'{"schema": "ckptfs.best", "version": 1, "metric": "loss", "mode": "min", '
    b'"pool": [{"step": 1, "value": 1.0}], "high_water": "low"}',
    b'{"schema": "ckptfs.best", "version": 1, "metric": "loss", "mode": "min", '
    b'"pool": [{"step": true, "value": 1.0}]}',
    b'{"schema": "ckptfs.best", "version": 1, "metric": "loss", "mode": "min", '
    b'"pool": [{"step": 1, "value": 1e999}]}',
    b'{"schema": "ckptfs.best", "version": 1, "metric": "loss", "mode": "sideways"}',
    b'{"schema": "ckptfs.best", "version": 7, "metric": "loss", "mode": "min"}',
    b'[1, 2]'])
def test_malformed_best_record_is_typed_and_deletes_nothing(
        backend: Backend, doc: bytes, capsys: pytest.CaptureFixture[str]) -> None:
    mgr = manager(backend, best=Best("loss", "min"))
    for s in (1, 2, 3):
        mgr.save(s, metrics={"loss": 4.0 - s})
    newest = max(int(re.findall(r"gen-([0-9]{12})", name)[0])
                 for name in backend.raw_files("lifecycle/best"))
    backend.raw_write(f"lifecycle/best/gen-{newest + 1:012d}.json", doc)
    if doc.startswith(b"["):  # not an object: that generation is skipped (it does not parse)
        assert read_best(backend.open()) is not None
        return
    with pytest.raises(CorruptRecordError, match="gen-") as ei:
        read_best(backend.open())
    assert isinstance(ei.value, CorruptCheckpointError) and isinstance(ei.value, ValueError)
    with pytest.raises(CorruptRecordError):
        manager(backend, best=Best("loss", "min")).restore_latest()
    with pytest.raises(CorruptRecordError):
        manager(backend, keep_last=1).prune()
    assert main(["prune", backend.url, "--keep-last", "1"]) == 1
    assert main(["best", backend.url]) == 1
    assert "Traceback" not in capsys.readouterr().err
    assert backend.open().steps() == [1, 2, 3]


def test_record_generation_deeply_nested_or_nan_falls_back(backend: Backend) -> None:
    log = RecordLog(backend.open().storage, "best")
    log.write({"v": 1}, expect_generation=None)
    backend.raw_write("lifecycle/best/gen-000000000002.json", b"[" * 100_000 + b"]" * 100_000)
    backend.raw_write("lifecycle/best/gen-000000000003.json", b'{"v": NaN}')
    backend.raw_write("lifecycle/best/gen-\u0661\u0661\u0661\u0661\u0661\u0661\u0661\u0661"
                      "\u0661\u0661\u0661\u0661.json", b'{"v": 9}')  # Unicode digits: not ours
    rec = log.read()
    assert rec is not None and rec.generation == 1 and rec.doc == {"v": 1}


def test_malformed_side_commit_record_is_typed_and_deletes_nothing(backend: Backend) -> None:
    mgr = manager(backend)
    path = mgr.write_side_output(1, "eval.json", b"{}")
    mgr.save(1)
    record = "lifecycle/side-commits/step-000000000001.json"
    for bad in (b"[" * 50_000, json.dumps({"side_outputs": {path: 3}}).encode(),
                json.dumps({"side_outputs": {path: {"size": 2, "digest": "evil:00"}}}).encode(),
                json.dumps({"side_outputs": {"../../etc": {"size": 2, "digest": "sha256:0"}}})
                .encode()):
        backend.raw_write(record, bad)
        with pytest.raises(CorruptRecordError, match="side-commits"):
            manager(backend).restore_latest()
        assert backend.raw_exists(path)


def test_malformed_provenance_refuses_typed(backend: Backend) -> None:
    backend.open().save(1, {"x": 1}, metadata={"provenance": {"fingerprints": "abc",
                                                              "execution": [1, 2]}})
    with pytest.raises(ProvenanceMismatchError, match="malformed"):
        manager(backend).restore_latest(expect=ckptfs.Provenance(config={"lr": 1}))


@pytest.mark.parametrize("entry", [
    [1, 2], {"world_size": 10 ** 12, "ranks": {}}, {"world_size": "2", "ranks": {}},
    {"world_size": 1, "ranks": [[0, {}]]}, {"world_size": 1, "ranks": {"zero": {}}},
    {"world_size": 1, "ranks": {0: "state"}}, {"world_size": 1, "ranks": {0: {"python": 1}}},
    {"world_size": 1, "ranks": {0: {**rng.capture(), "numpy": {"key": "x"}}}}])
def test_malformed_rng_entry_is_typed(entry: object) -> None:
    before = torch.get_rng_state()
    with pytest.raises(RngStateError):
        rng.restore_for_rank(entry, rank=0, world_size=1, run_seed=0)  # type: ignore[arg-type]
    torch.set_rng_state(before)


@pytest.mark.parametrize("trainer", [[1], {"step": "ten"}, {"epoch": 1.5}, {"extra": [1]}])
def test_malformed_trainer_state_is_typed_and_restores_nothing(backend: Backend,
                                                               trainer: object) -> None:
    model = torch.nn.Linear(2, 2)
    backend.open().save(1, {"model": torch.nn.Linear(2, 2).state_dict(), "trainer": trainer})
    before = model.weight.detach().clone()
    with pytest.raises(CorruptCheckpointError, match="trainer"):
        manager(backend).restore_latest(model=model)
    assert torch.equal(model.weight, before)


# -- concurrent gc and prune ---------------------------------------------------------------


class _OtherProcessFirst:
    """A storage on which "another process" finishes each removal first: the step directory
    is gone by the time this one's ``rmdir`` or ``sync_dir`` runs."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def sync_dir(self, path: str) -> None:
        self._inner.delete_tree(path)
        raise StorageNotFoundError(f"fsync {path}: not found (removed by another process)")

    def delete_tree(self, path: str) -> None:
        self._inner.delete_tree(path)
        self._inner.delete_tree(path.rsplit("/", 1)[0])  # and the empty step directory


def test_gc_and_prune_after_another_process_are_not_failures(local_backend: Backend) -> None:
    store = local_backend.open()
    for s in (1, 2, 3):
        store.save(s, {"x": torch.ones(2)})
    old = StepPaths(7).attempt_dir(new_attempt_name(datetime.now(timezone.utc) - 3 * HOUR))
    local_backend.raw_write(f"{old}/state.msgpack", b"x" * 8)
    racing = local_backend.open()
    racing.storage = _OtherProcessFirst(racing.storage)  # type: ignore[assignment]
    gc_report = collect(racing.storage, older_than=HOUR)
    assert [i.kind for i in gc_report.items] == ["attempt", "empty-step"]
    assert not any(i.error for i in gc_report.items), gc_report.as_dict()
    assert gc_report.items[1].note == "already removed by another process"
    report = prune(racing, RetentionPolicy(keep_last=1))
    assert report.errors == {} and report.already_gone == [1, 2]
    assert store.steps() == [3]


def test_concurrent_gc_and_prune_threads(backend: Backend) -> None:
    store = backend.open()
    for s in range(1, 13):
        store.save(s, {"x": torch.ones(2)})
    for s in range(20, 32):
        d = StepPaths(s).attempt_dir(new_attempt_name(datetime.now(timezone.utc) - 3 * HOUR))
        for f in range(3):
            backend.raw_write(f"{d}/f{f}", b"x" * 8)
    problems: list[str] = []

    def run_prune() -> None:
        try:
            r = prune(backend.open(), RetentionPolicy(keep_last=1))
            problems.extend(f"prune {k}: {v}" for k, v in r.errors.items())
            if r.refused:
                problems.append(f"prune refused: {r.refused}")
        except Exception as exc:  # pragma: no cover - reported below
            problems.append(repr(exc))

    def run_gc() -> None:
        try:
            r = collect(backend.open().storage, older_than=HOUR)
            problems.extend(f"gc {i.path}: {i.error}" for i in r.items if i.error)
        except Exception as exc:  # pragma: no cover - reported below
            problems.append(repr(exc))

    threads = [threading.Thread(target=f) for f in (run_prune, run_prune, run_gc, run_gc)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert problems == []
    assert backend.open().steps() == [12]


# -- CLI usage errors ----------------------------------------------------------------------


@pytest.mark.parametrize(("argv", "option"), [
    (["prune", "{url}", "--keep-last", "0"], "--keep-last"),
    (["prune", "{url}", "--keep-last", "-1"], "--keep-last"),
    (["prune", "{url}", "--keep-last", "9" * 5000], "--keep-last"),
    (["prune", "{url}", "--keep-last", "two"], "--keep-last"),
    (["prune", "{url}", "--keep-every", "0"], "--keep-every"),
    (["prune", "{url}", "--keep-last", "1", "--protect", "-3"], "--protect"),
    (["prune", "{url}", "--keep-last", "1", "--protect", "10000000000000"], "--protect"),
    (["gc", "{url}", "--older-than", "0"], "--older-than"),
    (["gc", "{url}", "--older-than=-1h"], "--older-than"),
    (["gc", "{url}", "--older-than", "99999999999d"], "--older-than"),
    (["gc", "{url}", "--older-than", "9" * 400], "--older-than"),
    (["gc", "{url}", "--older-than", "\u0661h"], "--older-than"),
    (["verify", "{url}", "--step", "-1"], "--step"),
    (["verify", "{url}", "--step", str(10 ** 20)], "--step"),
    (["doctor", "{url}", "--threads", "0"], "--threads"),
    (["doctor", "{url}", "--threads", "100000"], "--threads"),
    (["ls", "{url}", "-o", "novalue"], "-o"),
])
def test_cli_usage_errors_exit_2_naming_the_option(
        tmp_path: Any, capsys: pytest.CaptureFixture[str], argv: list[str], option: str) -> None:
    url = str(tmp_path / "run")
    rc = main([a.replace("{url}", url) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and option in err and "Traceback" not in err


def test_parse_duration_typed_errors() -> None:
    assert parse_duration("1h30m") == timedelta(minutes=90)
    for bad in ("1e400", "9" * 400 + "d", "-1h", "\u0661\u0662s", "1h 30m"):
        with pytest.raises(InvalidDurationError):
            parse_duration(bad)
