"""The ``latest`` question: storage requests and time to resolve the latest checkpoint among 10
to 10,000, with the request counters (`CountingStorage`, `count_http`)."""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any, BinaryIO

from ckptfs.storage.base import Entry, PendingUpload, Storage, StorageWrapper


class CountingStorage(StorageWrapper):
    """A storage wrapper counting every call by operation (``calls``): every
    `Storage` member and every optional capability, delegated
    explicitly (the capabilities of ``inner`` are kept: a sharded load still reads ranges)."""

    def __init__(self, inner: Storage) -> None:
        super().__init__(inner)
        self.calls: dict[str, int] = {}

    @property
    def total(self) -> int:
        return sum(self.calls.values())

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def read_bytes(self, path: str) -> bytes:
        self._count("read_bytes")
        return super().read_bytes(path)

    def open_read(self, path: str) -> AbstractContextManager[BinaryIO]:
        self._count("open_read")
        return super().open_read(path)

    def open_write(self, path: str) -> AbstractContextManager[BinaryIO]:
        self._count("open_write")
        return super().open_write(path)

    def write_bytes(self, path: str, data: bytes) -> None:
        self._count("write_bytes")
        super().write_bytes(path, data)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self._count("create_exclusive")
        super().create_exclusive(path, data)

    def list_dir(self, path: str) -> list[Entry]:
        self._count("list_dir")
        return super().list_dir(path)

    def list_tree(self, path: str) -> list[Entry]:
        self._count("list_tree")
        return super().list_tree(path)

    def exists(self, path: str) -> bool:
        self._count("exists")
        return super().exists(path)

    def delete(self, path: str) -> None:
        self._count("delete")
        super().delete(path)

    def delete_tree(self, path: str) -> None:
        self._count("delete_tree")
        super().delete_tree(path)

    def makedirs(self, path: str) -> None:
        self._count("makedirs")
        super().makedirs(path)

    def rename_dir(self, src: str, dst: str) -> None:
        self._count("rename_dir")
        super().rename_dir(src, dst)

    def sync_dir(self, path: str) -> None:
        self._count("sync_dir")
        super().sync_dir(path)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        self._count("read_range")
        return super().read_range(path, start, length)

    def modified(self, path: str) -> datetime | None:
        self._count("modified")
        return super().modified(path)

    def remove_empty_dir(self, path: str) -> bool:
        self._count("remove_empty_dir")
        return super().remove_empty_dir(path)

    def list_uploads(self, path: str) -> list[PendingUpload]:
        self._count("list_uploads")
        return super().list_uploads(path)

    def abort_upload(self, upload: PendingUpload) -> bool:
        self._count("abort_upload")
        return super().abort_upload(upload)


@contextmanager
def count_http(fs: Any) -> Iterator[dict[str, int]]:
    """Count the HTTP requests an s3fs filesystem makes, by operation (botocore events)."""
    counts: dict[str, int] = {}

    def handler(**kwargs: Any) -> None:
        model = kwargs.get("model")
        name = getattr(model, "name", "?")
        counts[name] = counts.get(name, 0) + 1

    fs.connect()
    events = fs.s3.meta.events
    events.register("before-call.s3", handler)
    try:
        yield counts
    finally:
        events.unregister("before-call.s3", handler)


def _populate(storage: Any, count: int, write: Callable[[dict[str, bytes]], None]) -> None:
    """``count - 1`` committed checkpoints made of real protocol files (state, manifest,
    marker), written directly with the raw filesystem, then one real save on top."""
    from datetime import datetime, timezone

    from ckptfs.format.hashing import DEFAULT_ALGORITHM, digest_bytes
    from ckptfs.format.layout import MANIFEST_NAME, StepPaths, new_attempt_name
    from ckptfs.format.manifest import FileEntry, Manifest, Marker
    from ckptfs.format.serialize import plan_state
    from ckptfs.protocol.commit import save_checkpoint
    from ckptfs.protocol.options import SaveOptions

    plan = plan_state({"step": 0})
    files = {pf.path: b"".join(bytes(c) for c in pf.chunks()) for pf in plan.files}
    entries = tuple(FileEntry(p, len(b), digest_bytes(DEFAULT_ALGORITHM, b))
                    for p, b in files.items())
    created = datetime.now(timezone.utc).isoformat(timespec="seconds")
    batch: dict[str, bytes] = {}
    for step in range(count - 1):
        attempt = new_attempt_name()
        paths = StepPaths(step)
        manifest = Manifest(step, attempt, entries, created, DEFAULT_ALGORITHM,
                            {"tensor_count": 0})
        mbytes = manifest.to_bytes()
        marker = Marker(step, attempt, digest_bytes(DEFAULT_ALGORITHM, mbytes), len(mbytes),
                        created, {"host": "bench", "pid": 0})
        d = paths.attempt_dir(attempt)
        for p, b in files.items():
            batch[f"{d}/{p}"] = b
        batch[f"{d}/{MANIFEST_NAME}"] = mbytes
        batch[paths.marker] = marker.to_bytes()
        if len(batch) >= 3000:
            write(batch)
            batch = {}
    if batch:
        write(batch)
    save_checkpoint(storage, count - 1, {"step": count - 1}, SaveOptions(durable=False))


def bench_latest(counts: Sequence[int] = (10, 100, 1000, 10000), *, reps: int = 5,
                 s3_max: int = 1000, backends: Sequence[str] = ("local", "s3"),
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Cost of resolving ``latest`` as the number of committed checkpoints grows."""
    from ckptfs.protocol.resolve import resolve_latest
    from ckptfs.storage.fsspec import FsspecStorage

    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ckptfs-latest-") as tmp, \
            _maybe_moto("s3" in backends) as srv:
        for backend in backends:
            for n in counts:
                if backend == "s3" and n > s3_max:
                    continue
                if backend == "local":
                    root = Path(tmp) / f"run{n}"
                    storage = FsspecStorage(str(root))

                    write = partial(_write_local, root)
                else:
                    assert srv is not None
                    srv.reset()
                    url = srv.url(f"run{n}")
                    storage = FsspecStorage(url, **srv.storage_options)
                    write = partial(_write_remote, srv.filesystem(), url)
                t0 = time.perf_counter()
                _populate(storage, n, write)
                populate_s = time.perf_counter() - t0
                times: list[float] = []
                calls: dict[str, int] = {}
                http: dict[str, int] = {}
                for _ in range(reps):
                    counting = CountingStorage(storage)
                    if backend == "s3":
                        with count_http(storage.fs) as http_counts:
                            t0 = time.perf_counter()
                            info = resolve_latest(counting)
                            times.append(time.perf_counter() - t0)
                        http = dict(http_counts)
                    else:
                        t0 = time.perf_counter()
                        info = resolve_latest(counting)
                        times.append(time.perf_counter() - t0)
                    calls = dict(counting.calls)
                    assert info is not None and info.step == n - 1
                row: dict[str, Any] = {"backend": backend, "checkpoints": n, "median_s": round(
                    statistics.median(times), 5), "storage_calls": calls,
                    "storage_calls_total": sum(calls.values()),
                    "http_requests": http or None,
                    "http_requests_total": sum(http.values()) if http else None,
                    "populate_s": round(populate_s, 1)}
                rows.append(row)
                log(f"  latest {backend} {n}: {row['median_s'] * 1000:.1f} ms, "
                    f"{row['storage_calls_total']} storage calls {calls}"
                    + (f", {row['http_requests_total']} HTTP {http}" if http else ""))
                if backend == "local":
                    shutil.rmtree(Path(tmp) / f"run{n}", ignore_errors=True)
    return {"question": "latest", "reps": reps, "rows": rows}


def _write_local(root: Path, batch: dict[str, bytes]) -> None:
    for rel, data in batch.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)


def _write_remote(fs: Any, url: str, batch: dict[str, bytes]) -> None:
    fs.pipe({f"{url}/{k}": v for k, v in batch.items()})


@contextmanager
def _maybe_moto(want: bool) -> Iterator[Any]:
    if not want:
        yield None
        return
    from ckptfs.testing.servers import moto_server

    with moto_server() as srv:
        yield srv

