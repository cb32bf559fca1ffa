"""``verify --remote`` against a full verify of the same checkpoint on S3 (moto) and GCS
(fake-gcs-server): requests made, bytes read and time, side by side.

A full verify reads every byte back and re-hashes it; a remote verify reads the marker and the
manifest (as every reader does), lists the attempt once and asks the store for each file's own
checksum (one metadata request per file), reading no data (docs/remote-verify.md).  Requests
are counted on the wire: botocore's ``before-call`` events for S3 (``count_http``, with the
``ContentLength`` of every GetObject answer for the bytes), and gcsfs's ``_request`` (every HTTP
request it makes, with the size of each answer's body) for GCS.  Both servers run on this
machine, so times measure the emulators' speed as much as ckptfs's: the request and byte counts
are what carries over to a real store.

Usage: ``python -m benchmarks.remote_verify [--size 1GiB] [--backends s3,gcs]``.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ckptfs.bench.common import machine_info, need
from ckptfs.bench.latest import count_http

#: Tensors in the benchmark's state (the size is split evenly between them).
TENSORS = 8
STEP = 1


@contextlib.contextmanager
def _count_s3(fs: Any) -> Iterator[dict[str, int]]:
    """Requests by operation (``count_http``) and ``bytes``: the body lengths of GetObject."""
    read = {"bytes": 0}

    def got(**kwargs: Any) -> None:
        parsed = kwargs.get("parsed") or {}
        read["bytes"] += int(parsed.get("ContentLength") or 0)

    with count_http(fs) as calls:
        events = fs.s3.meta.events
        events.register("after-call.s3.GetObject", got)
        try:
            yield calls
        finally:
            events.unregister("after-call.s3.GetObject", got)
            calls["bytes"] = read["bytes"]


@contextlib.contextmanager
def _count_gcs(fs: Any) -> Iterator[dict[str, int]]:
    """Requests by HTTP method and ``bytes``: the body lengths of every answer (gcsfs's
    ``_request``, wrapped on this filesystem object only)."""
    calls: dict[str, int] = {"bytes": 0}
    inner = fs._request

    async def request(method: str, path: Any, *args: Any, **kwargs: Any) -> Any:
        out = await inner(method, path, *args, **kwargs)
        calls[method] = calls.get(method, 0) + 1
        calls["bytes"] += len(out[3] or b"")
        return out

    fs._request = request
    try:
        yield calls
    finally:
        del fs._request  # the class's method again


def _state(size: int, tensors: int = TENSORS) -> dict[str, Any]:
    np = need("numpy", "ckptfs bench remote-verify")
    rng = np.random.default_rng(0)
    n = max(1, size // tensors // 4)
    return {f"layer{i}": rng.random(n, dtype=np.float32) for i in range(tensors)}


def _measure(name: str, fn: Callable[[], Any], counter: Any) -> dict[str, Any]:
    with counter as calls:
        t0 = time.perf_counter()
        report = fn()
        seconds = time.perf_counter() - t0
    reads = calls.pop("bytes")
    return {"variant": name, "seconds": seconds, "requests": sum(calls.values()),
            "by_operation": dict(sorted(calls.items())), "bytes_read": reads,
            "report": report.as_dict() if hasattr(report, "as_dict") else None}


def bench_backend(backend: str, size: int, tensors: int = TENSORS) -> dict[str, Any]:
    """Save a ``size``-byte checkpoint to a fresh server of ``backend`` (``s3``: moto, ``gcs``:
    fake-gcs-server), then a full verify and a remote verify of it, each counted."""
    from ckptfs.protocol.store import CheckpointStore
    from ckptfs.storage.fsspec import FsspecStorage
    from ckptfs.testing.servers import fake_gcs_server, moto_server

    server = moto_server if backend == "s3" else fake_gcs_server
    with server() as info:
        storage = FsspecStorage(info.url("rv-bench"), **info.storage_options)
        store = CheckpointStore(storage)
        t0 = time.perf_counter()
        saved = store.save(STEP, _state(size, tensors))
        save_s = time.perf_counter() - t0
        gc.collect()
        counter = _count_s3 if backend == "s3" else _count_gcs
        full = _measure("full verify", lambda: store.verify(STEP), counter(storage.fs))
        remote = _measure("verify --remote", lambda: store.verify(STEP, remote=True),
                          counter(storage.fs))
    files = [{"path": f.path, "size": f.size} for f in saved.manifest.files]
    return {"backend": backend, "server": "moto" if backend == "s3" else "fake-gcs-server",
            "size": saved.manifest.total_bytes, "files": files, "save_s": save_s,
            "variants": [full, remote]}


def bench_remote_verify(size: int, backends: Sequence[str] = ("s3", "gcs"), *,
                        tensors: int = TENSORS) -> dict[str, Any]:
    return {"question": "remote_verify", "size": size, "tensors": tensors,
            "machine": machine_info(),
            "runs": [bench_backend(b, size, tensors) for b in backends]}


def table(result: dict[str, Any]) -> str:
    """The side-by-side table (markdown)."""
    rows = ["| backend | checkpoint | variant | requests | bytes read | time | files compared |",
            "|---|---|---|---|---|---|---|"]
    for run in result["runs"]:
        for v in run["variants"]:
            rep = v["report"] or {}
            compared = (f"{rep.get('match', 0)} match, {rep.get('not_available', 0)} not "
                        "available" if rep.get("mode") == "remote" else "every byte re-hashed")
            ops = ", ".join(f"{k} {n}" for k, n in v["by_operation"].items())
            rows.append(f"| {run['backend']} ({run['server']}) | {_mib(run['size'])}, "
                        f"{len(run['files'])} files | {v['variant']} | {v['requests']} ({ops}) "
                        f"| {_mib(v['bytes_read'])} | {v['seconds']:.2f} s | {compared} |")
    rows.append("")
    rows.append("Bytes read: S3, the bodies of GetObject answers; GCS, every answer's body "
                "(listing and metadata JSON included).")
    return "\n".join(rows)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} B"
