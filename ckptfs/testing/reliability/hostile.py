"""Hostile-input sweep: checkpoints planted through the backdoor with a *valid* marker but
malicious contents (oversized or deeply nested documents, pickles, path tricks, symlinks, ...).
Each must give a typed error (`CkptfsError`) from latest/load/verify, with
no storage access outside the checkpoint, nothing written, nothing executed, and reader memory
within `HOSTILE_MEMORY_LIMIT`."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Callable, Mapping
from typing import Any

from ckptfs.errors import (
    CkptfsError,
    CorruptCheckpointError,
    FormatVersionError,
    UnsafeCheckpointError,
)
from ckptfs.format.layout import StepPaths
from ckptfs.protocol.store import CheckpointStore
from ckptfs.testing.backend import Backend
from ckptfs.testing.faults import FaultyStorage
from ckptfs.testing.reliability.common import (
    Evil,
    Sweep,
    plant_symlinked,
    raw_storage,
    state_for,
    store_on,
)

#: A hostile checkpoint may make the reader use at most this much Python memory.
HOSTILE_MEMORY_LIMIT = 64 * 1024 * 1024


class Planter:
    """Writes hostile checkpoints through the backdoor, each with a *valid* marker: the marker
    binds whatever manifest bytes the attacker chose, as an attacker can always arrange."""

    def __init__(self, backend: Backend) -> None:
        from ckptfs.format.hashing import digest_bytes
        from ckptfs.format.manifest import Marker

        self.backend = backend
        self._digest = digest_bytes
        self._marker = Marker
        donor = store_on(raw_storage(backend))
        info = donor.save(0, state_for(0))
        self.files = {e.path: backend.raw_read(f"{info.path}/{e.path}")
                      for e in info.manifest.files}
        self.step = 1000

    def entries(self, files: dict[str, bytes]) -> list[dict[str, Any]]:
        return [{"path": p, "size": len(d), "digest": self._digest("sha256", d),
                 "algorithm": "sha256"} for p, d in files.items()]

    def plant(self, *, files: dict[str, bytes] | None = None,
              entries: list[dict[str, Any]] | None = None, manifest: bytes | None = None,
              doc_edit: Callable[[dict[str, Any]], None] | None = None,
              marker_edit: Callable[[dict[str, Any]], None] | None = None) -> int:
        from ckptfs.format.layout import new_attempt_name

        self.step += 1
        step = self.step
        files = dict(self.files if files is None else files)
        attempt = new_attempt_name()
        adir = StepPaths(step).attempt_dir(attempt)
        for rel, data in files.items():
            self.backend.raw_write(f"{adir}/{rel}", data)
        doc: dict[str, Any] = {
            "schema": "ckptfs.manifest", "format_version": 1, "step": step, "attempt": attempt,
            "created": "2026-01-01T00:00:00+00:00", "hash_algorithm": "sha256",
            "files": self.entries(files) if entries is None else entries, "metadata": {}}
        if doc_edit is not None:
            doc_edit(doc)
        mbytes = manifest if manifest is not None else json.dumps(doc).encode()
        self.backend.raw_write(f"{adir}/MANIFEST.json", mbytes)
        marker = json.loads(self._marker(step, attempt, self._digest("sha256", mbytes),
                                         max(1, len(mbytes)), "2026-01-01T00:00:00+00:00",
                                         {}).to_bytes())
        if marker_edit is not None:
            marker_edit(marker)
        self.backend.raw_write(StepPaths(step).marker, json.dumps(marker).encode())
        return step


def _packb(obj: Any) -> bytes:
    import msgpack

    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


def _state_doc(tree: Any, tensors: list[Any] | None = None) -> bytes:
    return _packb({"schema": "ckptfs.state", "format_version": 1, "tree": tree,
                   "tensors": tensors or []})


def _nested_msgpack(depth: int) -> bytes:
    # ["l", ["l", [...]]] built as bytes, so building it needs no recursion
    inner = _packb(None)
    for _ in range(depth):
        inner = b"\x92" + _packb("l") + b"\x91" + inner
    head = _packb({"schema": "ckptfs.state", "format_version": 1, "tensors": []})
    # replace the 3-entry map header with a 4-entry one and append the "tree" key
    return bytes([head[0] + 1]) + head[1:] + _packb("tree") + inner


def hostile_cases(pl: Planter, sentinel: str, *, local: bool
                  ) -> list[tuple[str, Callable[[], int], str]]:
    """(name, plant -> step, expected) for every hostile input; ``expected`` is what load must
    raise (`EXPECTED_ERRORS`): "unsafe" (`UnsafeCheckpointError`), "version"
    (`FormatVersionError`), "typed" (`CorruptCheckpointError`, any subclass), or
    "" (may load, harmlessly)."""
    import io
    import pickle
    import struct

    f = pl.files
    state, shard = f["state.msgpack"], f["tensors-00000.safetensors"]
    cases: list[tuple[str, Callable[[], int], str]] = []

    def add(name: str, fn: Callable[[], int], expected: str = "typed") -> None:
        cases.append((name, fn, expected))

    def with_path(path: str) -> Callable[[], int]:
        def build() -> int:
            entries = pl.entries(f)
            entries.append({"path": path, "size": 4, "digest": pl._digest("sha256", b"evil"),
                            "algorithm": "sha256"})
            return pl.plant(entries=entries)
        return build

    for path in ["/etc/passwd", "../../secret.bin", "a/../../../secret.bin", "..", ".",
                 "..\\..\\secret.bin", "tensors\\x.safetensors", "state.msgpack\x00.txt",
                 "s3://other-bucket/key", "file:///etc/passwd", "gs://b/k", "C:/Windows/x",
                 "MANIFEST.json", "COMPLETE", ".hidden", "", "a//b", "x" * 600, "./x",
                 "tens\u00f6rs", "a/./b", "~/x", "%2e%2e/secret"]:
        add(f"manifest path {path[:40]!r}", with_path(path), "unsafe")

    def entry_edit(**change: Any) -> Callable[[], int]:
        def build() -> int:
            entries = pl.entries(f)
            for e in entries:
                if e["path"] == change.get("target", "tensors-00000.safetensors"):
                    e.update({k: v for k, v in change.items() if k != "target"})
            return pl.plant(entries=entries)
        return build

    for size in [1 << 50, (1 << 50) + 1, 1 << 40, 1 << 33, -1, True, 1.5, "12", None]:
        add(f"declared size {size!r} of a tensor file", entry_edit(size=size))
    add("declared size 1 PiB of state.msgpack", entry_edit(target="state.msgpack", size=1 << 50))
    add("declared size 16 GiB of state.msgpack",
        entry_edit(target="state.msgpack", size=1 << 34))
    add("digest with an unknown algorithm", entry_edit(digest="md5:00", algorithm="md5"))
    add("digest not hex", entry_edit(digest="sha256:zz"))
    add("duplicate file entries", lambda: pl.plant(entries=pl.entries(f) + pl.entries(f)))
    add("files is not a list", lambda: pl.plant(doc_edit=lambda d: d.update(files={"a": 1})))
    add("format version from the future",
        lambda: pl.plant(doc_edit=lambda d: d.update(format_version=99)), "version")
    add("manifest is not JSON", lambda: pl.plant(manifest=b"\x80\x04\x95pickle"))
    add("manifest with NaN", lambda: pl.plant(manifest=b'{"schema": NaN}'))
    add("manifest JSON nested 100000 deep",
        lambda: pl.plant(manifest=b'{"schema":' + b"[" * 100_000 + b"]" * 100_000 + b"}"))
    add("manifest step differs from its directory",
        lambda: pl.plant(doc_edit=lambda d: d.update(step=1)))
    add("marker names an attempt with '..'",
        lambda: pl.plant(marker_edit=lambda m: m.update(attempt="../../x")))
    add("marker names another step", lambda: pl.plant(marker_edit=lambda m: m.update(step=1)))
    add("marker declares a 1 TiB manifest",
        lambda: pl.plant(marker_edit=lambda m: m.update(manifest_size=1 << 40)))

    def with_files(**repl: bytes) -> Callable[[], int]:
        def build() -> int:
            files = dict(f)
            files.update({k.replace("__", "."): v for k, v in repl.items()})
            return pl.plant(files=files)
        return build

    hlen_huge = struct.pack("<Q", 1 << 60) + b"{}" + b" " * 6
    add("safetensors header length 2^60", with_files(**{"tensors-00000__safetensors": hlen_huge}))
    add("safetensors header length beyond the file",
        with_files(**{"tensors-00000__safetensors": struct.pack("<Q", 1000) + b"{}"}))
    add("safetensors header of 150 MB declared",
        with_files(**{"tensors-00000__safetensors": struct.pack("<Q", 150 << 20) + b"{}"}))

    def st_header(header: dict[str, Any], data: bytes = b"") -> bytes:
        h = json.dumps(header).encode()
        h += b" " * (-len(h) % 8)
        return struct.pack("<Q", len(h)) + h + data

    def shard_with(header: dict[str, Any], data: bytes = b"") -> Callable[[], int]:
        return with_files(**{"tensors-00000__safetensors": st_header(header, data)})

    add("safetensors offsets beyond the data",
        shard_with({"model.w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 1 << 40]}},
                   b"\0" * 64))
    add("safetensors shape product overflows",
        shard_with({"model.w": {"dtype": "F32", "shape": [1 << 62, 1 << 62],
                                "data_offsets": [0, 64]}}, b"\0" * 64))
    add("safetensors dtype 'PICKLE'",
        shard_with({"model.w": {"dtype": "PICKLE", "shape": [16], "data_offsets": [0, 64]}},
                   b"\0" * 64))
    add("safetensors negative dimension",
        shard_with({"model.w": {"dtype": "F32", "shape": [-4, -4], "data_offsets": [0, 64]}},
                   b"\0" * 64))
    add("safetensors overlapping tensors",
        shard_with({"a": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]},
                    "b": {"dtype": "F32", "shape": [16], "data_offsets": [0, 64]}},
                   b"\0" * 64))
    add("safetensors header nested 100000 deep",
        with_files(**{"tensors-00000__safetensors": (
            lambda h: struct.pack("<Q", len(h)) + h)(b"[" * 100_000 + b"]" * 100_000)}))

    evil = pickle.dumps(Evil(sentinel))
    add("state.msgpack is a pickle", with_files(state__msgpack=evil))
    buf = io.BytesIO()
    import torch as _torch

    _torch.save({"x": Evil(sentinel)}, buf)
    add("tensor file is a torch.save zip (pickle inside)",
        with_files(**{"tensors-00000__safetensors": buf.getvalue()}))
    add("a pickle listed in the manifest but referenced by nothing",
        with_files(**{"data__pkl": evil}), "")
    add("state.msgpack nested 100000 deep", with_files(state__msgpack=_nested_msgpack(100_000)))
    add("state tree nested 300 deep (valid msgpack, beyond the tree limit)",
        with_files(state__msgpack=_nested_msgpack(300)))
    add("msgpack array header claiming 2^32-1 items",
        with_files(state__msgpack=b"\xdd\xff\xff\xff\xff" + b"\xc0" * 8))
    add("msgpack str header claiming 4 GiB",
        with_files(state__msgpack=b"\xdb\xff\xff\xff\xff" + b"a" * 8))
    add("msgpack map with 2^32-1 entries declared",
        with_files(state__msgpack=b"\xdf\xff\xff\xff\xff"))
    add("msgpack ext type in the document",
        with_files(state__msgpack=_state_doc(None)[:-1] + b"\xd4\x05\x00"), "unsafe")
    # ext -1 (timestamp) is decoded by msgpack itself into an inert Timestamp, never through
    # the ext hook: the document/tree checks reject it (CorruptCheckpointError)
    add("msgpack timestamp ext (-1) as the tensor list",
        with_files(state__msgpack=_state_doc(None)[:-1] + b"\xd6\xff\x00\x00\x00\x00"))
    add("msgpack timestamp ext (-1) in the tree",
        with_files(state__msgpack=_state_doc(["d", [["t", None]]])
                   .replace(b"\xc0", b"\xd6\xff\x00\x00\x00\x00")))
    add("msgpack trailing garbage", with_files(state__msgpack=state + b"\x00"))
    add("tensor slot naming '../secret.safetensors'",
        with_files(state__msgpack=_state_doc(["T", 0], [["../secret.safetensors", "w", "F32",
                                                         [4]]])), "unsafe")
    add("tensor slot naming an absolute path",
        with_files(state__msgpack=_state_doc(["T", 0], [["/etc/passwd", "w", "F32", [4]]])),
        "unsafe")
    add("tensor reference out of range",
        with_files(state__msgpack=_state_doc(["T", 99])))
    add("dtype tag naming a torch function",
        with_files(state__msgpack=_state_doc(["d", [["x", ["dt", "load"]]]])))
    add("dtype tag naming a dunder",
        with_files(state__msgpack=_state_doc(["dt", "__class__"])))
    add("big int of a million digits",
        with_files(state__msgpack=_state_doc(["i", "9" * 1_000_000])))
    add("unknown tag", with_files(state__msgpack=_state_doc(["pickle", "cos\nsystem"])))
    add("unhashable dict key",
        with_files(state__msgpack=_state_doc(["d", [[["l", []], None]]])))
    add("state root is a list", with_files(state__msgpack=_state_doc(["l", []])))
    add("state document of another schema",
        with_files(state__msgpack=_packb({"schema": "evil", "format_version": 1})))
    _ = shard
    if local:
        add("state.msgpack is a symlink to a file outside the root", lambda: plant_symlinked(
            pl, "state.msgpack", sentinel + ".secret"), "unsafe")
        add("attempt directory is a symlink", lambda: plant_symlinked(pl, None, None), "unsafe")
    return cases


def _recorder(paths: list[str]) -> Callable[[str, str], None]:
    return lambda op, path: paths.append(path)


#: What a reader does with a hostile checkpoint, by operation (``hostile_sweep(reads=...)``).
#: The loads and the copy must refuse it (`REFUSING`, and every reader given as
#: ``hostile_sweep(extra=...)``: the tests add ``ckptfs inspect``'s), all with the same error
#: class; the full verification must refuse it too (`REPORTING`: it reports every problem
#: in one `CorruptCheckpointError`, whatever the kind of each); ``latest`` and the quick
#: verification may pass (they read no document content), but may raise nothing untyped.
READS = ("latest", "load", "load unverified", "verify", "verify quick", "copy")
REFUSING = ("load", "load unverified", "copy")
REPORTING = ("verify",)
#: Another reader: ``reader(store, step)``.
Reader = Callable[[CheckpointStore, int], object]
#: What load must raise, by the ``expected`` of a case.
EXPECTED_ERRORS: dict[str, type[CkptfsError]] = {
    "typed": CorruptCheckpointError, "unsafe": UnsafeCheckpointError,
    "version": FormatVersionError}


def _copy_refused(reader: CheckpointStore, step: int, sweep: Sweep, name: str) -> None:
    """``ckptfs cp`` of the hostile step into a fresh root: whatever it raises propagates, and
    nothing may be committed (nor left) at the destination."""
    from ckptfs.protocol.copy import copy_step
    from ckptfs.storage.fsspec import FsspecStorage

    dst = FsspecStorage(f"memory://hostile-copy-{uuid.uuid4().hex[:12]}")
    try:
        copy_step(reader.storage, dst, step, threads=1)
    except BaseException:
        left = [e.name for e in dst.list_tree("")] if dst.exists("") else []
        if dst.exists(StepPaths(step).marker):
            sweep.bad(name, "the refused copy committed the step at the destination")
        elif left:
            sweep.bad(name, f"the refused copy left files at the destination: {left[:3]}")
        raise
    finally:
        if dst.exists(""):
            dst.delete_tree("")


def hostile_sweep(backend: Backend, *, fmt: int = 1, reads: tuple[str, ...] = READS,
                  extra: Mapping[str, Reader] | None = None, only: set[str] | None = None,
                  planter: Any = None) -> Sweep:
    """Every hostile input (of format ``fmt``: `hostile_cases`,
    `hostile_v2_cases` or
    `hostile_v3_cases`), through every reader in
    ``reads``: the loads, the copy and inspect refuse it with the error of its kind
    (`EXPECTED_ERRORS`), all of them with the same error class, and the full verification
    refuses it too (`REPORTING`); the copy commits nothing;
    no operation raises anything untyped, accesses storage outside the checkpoints, writes to
    storage, executes anything, or uses more than `HOSTILE_MEMORY_LIMIT`.
    ``sweep.outcomes[case]`` records what each operation did.  ``extra``: more readers, which
    must refuse too (the tests pass ``ckptfs inspect``'s).  ``only``: these cases;
    ``planter``: a planter of ``fmt`` for ``backend`` made earlier (its donor save reused)."""
    import tempfile
    import tracemalloc

    sweep = Sweep(backend.name, "hostile" if fmt == 1 else f"hostile (format v{fmt})")
    local = backend.protocol == "file"
    inner = raw_storage(backend)
    with tempfile.TemporaryDirectory() as tmp:
        sentinel = os.path.join(tmp, "EXECUTED")
        if fmt == 1:
            cases = hostile_cases(planter or Planter(backend), sentinel, local=local)
        elif fmt == 3:
            from ckptfs.testing.reliability.hostile_v3 import PlanterV3, hostile_v3_cases

            cases = hostile_v3_cases(planter or PlanterV3(backend), sentinel, local=local)
        else:
            from ckptfs.testing.reliability.hostile_v2 import PlanterV2, hostile_v2_cases

            cases = hostile_v2_cases(planter or PlanterV2(backend), sentinel, local=local)
        if only is not None:
            cases = [c for c in cases if c[0] in only]
            if {c[0] for c in cases} != only:
                raise ValueError(f"no such hostile cases: {only - {c[0] for c in cases}}")
        for name, build, expected in cases:
            sweep.tried += 1
            try:
                step = build()
            except Exception as exc:  # pragma: no cover - a harness bug, reported
                sweep.bad(name, f"could not plant: {exc!r}")
                continue
            paths: list[str] = []
            audited = FaultyStorage(inner, hook=_recorder(paths))
            reader = CheckpointStore(audited, threads=1)
            before = backend.raw_files()
            outside_before = set(os.listdir(tmp))
            ops: dict[str, Callable[[], object]] = {
                "latest": reader.latest, "load": lambda: reader.load(step),  # noqa: B023
                "load unverified": lambda: reader.load(step, verify=False),  # noqa: B023
                "verify": lambda: reader.verify(step),  # noqa: B023
                "verify quick": lambda: reader.verify(step, quick=True),  # noqa: B023
                "copy": lambda: _copy_refused(reader, step, sweep, name)}  # noqa: B023
            for op_name, fn in (extra or {}).items():
                ops[op_name] = lambda fn=fn: fn(reader, step)  # type: ignore[misc]  # noqa: B023
            refusing = (*REFUSING, *(extra or {}))
            outcome: dict[str, str] = {}
            tracemalloc.start()
            try:
                for op_name in (*reads, *(extra or {})):
                    try:
                        ops[op_name]()
                        outcome[op_name] = "ok"
                    except CkptfsError as exc:
                        sweep.count(type(exc).__name__)
                        outcome[op_name] = type(exc).__name__
                        want = EXPECTED_ERRORS.get(expected)
                        if (want is not None and op_name in refusing
                                and not isinstance(exc, want)):
                            sweep.bad(name, f"{op_name} raised {type(exc).__name__}, not "
                                      f"{want.__name__}: {str(exc)[:200]}")
                    except BaseException as exc:
                        outcome[op_name] = f"untyped {type(exc).__name__}"
                        sweep.bad(name, f"{op_name} raised untyped {type(exc).__name__}: "
                                  f"{str(exc)[:200]}")
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            sweep.outcomes[name] = outcome
            accepted = [op for op in (*refusing, *REPORTING) if outcome.get(op) == "ok"]
            if expected and accepted:
                sweep.bad(name, f"accepted by {accepted}")
            refused = {outcome[op] for op in refusing if op in outcome and outcome[op] != "ok"}
            if expected and len(refused) > 1:
                sweep.bad(name, "not the same error through every path: " + ", ".join(
                    f"{op}: {outcome[op]}" for op in refusing if op in outcome))
            if peak > HOSTILE_MEMORY_LIMIT:
                sweep.bad(name, f"peak Python memory {peak >> 20} MiB")
            sweep.counters["peak_bytes_max"] = max(sweep.counters.get("peak_bytes_max", 0), peak)
            for p in paths:
                parts = p.split("/")
                if (parts[0] != "checkpoints" or ".." in parts
                        or any(c in p for c in ("\\", "\x00", ":"))):
                    sweep.bad(name, f"storage accessed outside the checkpoints: {p!r}")
            if backend.raw_files() != before:
                sweep.bad(name, "reading wrote to storage")
            if os.path.exists(sentinel):
                sweep.bad(name, "code was executed (the pickle's sentinel exists)")
                os.unlink(sentinel)
            if set(os.listdir(tmp)) - outside_before:
                sweep.bad(name, "a file appeared outside the root")
            # the hostile step must not stop the next save (it is the newest)
            backend.raw_delete(StepPaths(step).dir)
    return sweep
