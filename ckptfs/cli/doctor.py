"""``ckptfs doctor URL``: does *this* store give the guarantees the commit protocol relies on?

The capability table (`ckptfs.storage.backends`) says what a backend *should* do; an
emulator, a MinIO/Ceph/R2 deployment or a proxy in front of a real bucket may not.  The doctor
measures it, under a fresh prefix ``<url>/.ckptfs-doctor-<random>/``, through the same adapter
and library calls ckptfs uses, and removes everything it wrote (multipart uploads included)::

    exclusive_create    a create-only write of an existing object is refused (the commit)
    create_race         8 clients racing to create one object: exactly one wins
    listing_fresh       a second client's listing shows a new object at once (resolve latest)
    delete_visible      a deleted object is gone for a second client at once (delete, prune)
    ranged_read         ranged / chunked reads return the right bytes (load)
    exclusive_multipart create-only also holds for a write split into several requests
    empty_create        a zero-byte create-only write does not truncate an existing object

The first five are *needed*: if one is missing the doctor exits non-zero.  The last two are
traps ckptfs avoids (the marker is small, non-empty and goes up in one request); they are
reported so users know not to rely on them elsewhere.
"""

from __future__ import annotations

import argparse
import threading
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ckptfs.errors import CheckpointExistsError, CkptfsError, StorageNotFoundError
from ckptfs.storage.fsspec import (
    FsspecStorage,
    describe_cause,
    discard_write,
    is_precondition_failure,
)

Status = Literal["held", "not held", "n/a", "error"]

PREFIX = ".ckptfs-doctor-"


@dataclass(frozen=True)
class Check:
    name: str
    #: The guarantee, in words.
    guarantee: str
    #: The commit protocol depends on it (a missing one fails the doctor).
    needed: bool
    status: Status
    #: What ckptfs's capability table declares for this backend.
    declared: str
    #: What was observed (the library's exception class, sizes, counts).
    detail: str
    #: What the result means for ckptfs.
    meaning: str


@dataclass
class DoctorReport:
    url: str
    probe_url: str
    protocol: str
    capabilities: dict[str, Any]
    checks: list[Check] = field(default_factory=list)
    #: Anything the doctor wrote that it could not remove (should be empty).
    leftovers: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.leftovers and all(c.status == "held" for c in self.checks if c.needed)

    def check(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out

    def render(self) -> str:
        rows = [("guarantee", "needed", "result", "declared", "observed", "for ckptfs")]
        for c in self.checks:
            rows.append((c.name, "yes" if c.needed else "no", c.status, c.declared, c.detail,
                         c.meaning))
        lines = [f"ckptfs doctor {self.url} ({self.protocol})", ""]
        lines += ["| " + " | ".join(r) + " |" for r in rows[:1]]
        lines.append("|" + "|".join("---" for _ in rows[0]) + "|")
        lines += ["| " + " | ".join(r) + " |" for r in rows[1:]]
        lines.append("")
        lines.append("cleanup: " + ("everything removed" if not self.leftovers
                                    else "LEFT BEHIND: " + ", ".join(self.leftovers)))
        missing = [c.name for c in self.checks if c.needed and c.status != "held"]
        lines.append("verdict: " + ("OK: every guarantee ckptfs needs holds" if self.ok else
                                    "FAILED: " + (", ".join(missing) or "cleanup")
                                    + " (see above)"))
        return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


class _Doctor:
    def __init__(self, url: str, threads: int, storage_options: dict[str, Any]) -> None:
        self.url = url.rstrip("/")
        self.options = storage_options
        # Fails here, typed, for a missing bucket, refused credentials or a dead endpoint.
        self.base = FsspecStorage(self.url, **storage_options)
        # A local run root the doctor creates is removed again (if still empty).
        self.root_existed = (not self.base.capabilities.real_directories
                             or bool(self.base.fs.exists(self.base.root)))
        self.prefix = f"{PREFIX}{uuid.uuid4().hex[:12]}"
        self.probe_url = f"{self.url}/{self.prefix}"
        self.a = self.client()
        self.b = self.client()
        self.threads = threads
        self.spec = self.a.spec
        self.caps = self.a.capabilities

    def client(self) -> FsspecStorage:
        """A new client on the probe prefix: its own fsspec instance, nothing shared."""
        return FsspecStorage(self.probe_url, probe=False,
                             **{"skip_instance_cache": True, **self.options})

    # -- the raw create-only write, as ckptfs does it ---------------------------------------------

    def create(self, st: FsspecStorage, path: str, data: bytes) -> BaseException | None:
        """Create-only write of ``path``; returns the library's exception (None if it
        succeeded).  Object stores: the raw ``pipe_file(mode="create")`` ckptfs uses, so the
        exception the *library* raised can be reported; others: the adapter's create."""
        try:
            if self.caps.exclusive_create == "server_precondition":
                st.fs.pipe_file(st.full(path), data, mode="create")
            else:
                st.create_exclusive(path, data)
        except Exception as exc:
            return exc
        return None

    # -- checks ----------------------------------------------------------------------------------

    def exclusive_create(self) -> Check:
        declared = self.caps.exclusive_create
        meaning_ok = ("two writers of one step: exactly one commits, the other gets "
                      "CheckpointExistsError")
        meaning_bad = ("a zombie writer and its replacement can both 'commit' one step; the "
                       "last marker wins (verify still detects a mix of files)")
        first = self.create(self.a, "excl/COMPLETE", b"first")
        if first is not None:
            return Check("exclusive_create", "create-only write refused if the object exists",
                         True, "error", declared, f"first create failed: "
                         f"{describe_cause(first)}", meaning_bad)
        second = self.create(self.b, "excl/COMPLETE", b"second")
        content = self.a.read_bytes("excl/COMPLETE")
        if second is None:
            status: Status = "not held"
            detail = f"second create succeeded; object now {content!r}"
        elif is_precondition_failure(second):
            status = "held" if content == b"first" else "not held"
            state = "intact" if status == "held" else "changed"
            detail = f"refused with {_shape(second)}; object {state}"
        else:
            status = "error"
            detail = f"second create failed, not as 'exists': {describe_cause(second)}"
        return Check("exclusive_create", "create-only write refused if the object exists", True,
                     status, declared, detail, meaning_ok if status == "held" else meaning_bad)

    def create_race(self) -> Check:
        n = self.threads
        clients = [self.client() for _ in range(n)]
        barrier = threading.Barrier(n)
        wins: list[int] = []
        errors: list[str] = []
        lock = threading.Lock()

        def racer(i: int) -> None:
            barrier.wait()
            try:
                clients[i].create_exclusive("race/COMPLETE", f"writer-{i}".encode())
                with lock:
                    wins.append(i)
            except CheckpointExistsError:
                pass
            except Exception as exc:
                with lock:
                    errors.append(describe_cause(exc))

        threads = [threading.Thread(target=racer, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        content = self.a.read_bytes("race/COMPLETE") if wins else b""
        ok = len(wins) == 1 and content == f"writer-{wins[0]}".encode() and not errors
        detail = f"{len(wins)} of {n} won"
        if errors:
            detail += f"; {len(errors)} failed otherwise: {errors[0]}"
        scope = "" if self.caps.shared else " (within this process only: memory:// is private)"
        return Check(
            "create_race", f"{n} clients racing to create one object: exactly one wins", True,
            "held" if ok else ("error" if errors else "not held"),
            self.caps.exclusive_create, detail + scope,
            "racing writers of one step never both commit" if ok else
            "racing writers of one step can both commit; run one writer per run root")

    def listing_fresh(self) -> Check:
        before = self.b.list_tree("vis")  # primes any listing cache the library keeps
        self.a.write_bytes("vis/new.bin", b"x")
        tree = [e.name for e in self.b.list_tree("vis")]
        top = [e.basename for e in self.b.list_dir("vis")]
        ok = not before and tree == ["vis/new.bin"] and top == ["new.bin"]
        return Check(
            "listing_fresh", "a second client lists a new object at once", True,
            "held" if ok else "not held", self.spec.listing_cache or "-",
            f"before={len(before)} after: tree={tree}, dir={top}",
            "latest() and steps() in any process see a commit at once" if ok else
            "another process may not see a new commit: it could resume from an older step")

    def delete_visible(self) -> Check:
        self.a.delete("vis/new.bin")
        gone_exists = not self.b.exists("vis/new.bin")
        gone_list = self.b.list_tree("vis") == []
        try:
            self.b.read_bytes("vis/new.bin")
            gone_read = False
        except StorageNotFoundError:
            gone_read = True
        ok = gone_exists and gone_list and gone_read
        return Check(
            "delete_visible", "a deleted object is gone for a second client at once", True,
            "held" if ok else "not held", "-",
            f"exists={not gone_exists}, listed={not gone_list}, readable={not gone_read}",
            "a deleted or pruned checkpoint is never resolved again" if ok else
            "a deleted checkpoint may still be resolved for a while")

    def ranged_read(self) -> Check:
        data = bytes(range(256)) * 1024  # 256 KiB
        self.a.write_bytes("range/data.bin", data)
        part = self.b.fs.cat_file(self.b.full("range/data.bin"), start=1000, end=70000)
        buf = bytearray(len(data))
        view = memoryview(buf)
        pos = 0
        with self.b.open_read("range/data.bin") as f:
            while pos < len(data):
                got = f.readinto(view[pos:pos + 65536])  # type: ignore[attr-defined]
                if not got:
                    break
                pos += got
        ok = bytes(part) == data[1000:70000] and bytes(buf) == data and pos == len(data)
        return Check(
            "ranged_read", "ranged and chunked reads return the right bytes", True,
            "held" if ok else "not held", "-",
            f"range {len(part)} bytes {'match' if bytes(part) == data[1000:70000] else 'DIFFER'}"
            f"; chunked read {pos} bytes {'match' if bytes(buf) == data else 'DIFFER'}",
            "loading streams files in chunks, verifying as it reads" if ok else
            "loading cannot stream files: checkpoints cannot be read")

    def exclusive_multipart(self) -> Check:
        block = self.spec.min_block_size
        declared = _yes(self.caps.exclusive_multipart)
        guarantee = "create-only holds for a write split into several requests"
        if block is None:
            return Check("exclusive_multipart", guarantee, False, "n/a", declared,
                         'streaming writes are one stream; open("xb") is the OS create',
                         "nothing to check")
        size = 2 * block + 1024
        path = self.a.full("big/object.bin")
        self._write_xb(self.a, path, b"a" * size, block)
        err: BaseException | None = None
        try:
            self._write_xb(self.b, path, b"b" * size, block)
        except Exception as exc:
            err = exc
        head = bytes(self.a.fs.cat_file(path, start=0, end=16))
        size_now = int(self.a.fs.info(path)["size"])
        intact = head == b"a" * 16 and size_now == size
        if err is None:
            status: Status = "not held"
            state = "intact" if intact else "replaced"
            detail = f"second {size}-byte create-only upload succeeded (object {state})"
        elif is_precondition_failure(err):
            status = "held" if intact else "not held"
            detail = f"second {size}-byte upload refused with {_shape(err)}"
        else:
            status = "error"
            detail = f"second upload failed, not as 'exists': {describe_cause(err)}"
        return Check(
            "exclusive_multipart", guarantee, False, status, declared, detail,
            "large create-only uploads are safe too (ckptfs does not need it)"
            if status == "held" else
            "only single-request create-only writes are enforced; ckptfs's marker is one "
            "small request, so commits are unaffected")

    def _write_xb(self, st: FsspecStorage, path: str, data: bytes, block: int) -> None:
        f = st.fs.open(path, "xb", block_size=block)
        try:
            for i in range(0, len(data), block // 2):
                f.write(data[i:i + block // 2])
            f.close()
        except BaseException:
            discard_write(f)
            raise

    def empty_create(self) -> Check:
        declared = _yes(self.caps.empty_create_safe)
        self.a.write_bytes("empty/object.bin", b"payload")
        full = self.b.full("empty/object.bin")
        err: BaseException | None = None
        try:
            f = self.b.fs.open(full, "xb")
            f.close()
        except Exception as exc:
            err = exc
        content = self.a.read_bytes("empty/object.bin")
        if err is not None and is_precondition_failure(err):
            status: Status = "held"
            detail = f"refused with {_shape(err)}"
        elif err is not None:
            status = "error"
            detail = f"failed, not as 'exists': {describe_cause(err)}"
        else:
            status = "not held"
            detail = ("no error, and the existing object was truncated to 0 bytes"
                      if content == b"" else f"no error; object now {content!r}")
        return Check(
            "empty_create", 'a zero-byte open("xb") does not overwrite an existing object',
            False, status, declared, detail,
            "empty create-only writes are safe" if status == "held" else
            "ckptfs never writes an empty marker, so commits are unaffected; do not rely on "
            "empty create-only writes with this library")

    # -- cleanup ---------------------------------------------------------------------------------

    def cleanup(self) -> list[str]:
        left: list[str] = []
        with suppress(Exception):
            self.a.delete_tree("")
        left += self._abort_uploads()
        try:
            remaining = [e.name for e in self.base.list_tree(self.prefix)]
            remaining += [e.name for e in self.base.list_dir("")
                          if e.basename == self.prefix]
        except CkptfsError as exc:
            remaining = [f"(could not list {self.probe_url}: {exc})"]
        left += sorted(set(remaining))
        if not self.root_existed and not left:
            with suppress(OSError):
                self.base.fs.rmdir(self.base.root)
        return left

    def _abort_uploads(self) -> list[str]:
        """Abort multipart uploads left under the prefix (s3fs leaves one open when a
        create-only multipart commit is refused).  Returns those it could not abort."""
        fs = self.a.fs
        lister: Callable[[str], list[dict[str, Any]]] | None = getattr(
            fs, "list_multipart_uploads", None)
        if lister is None:
            return []
        bucket, _, key_root = self.a.root.partition("/")
        left = []
        try:
            uploads = lister(bucket)
        except Exception as exc:
            return [f"(could not list multipart uploads: {describe_cause(exc)})"]
        for up in uploads or []:
            key = str(up.get("Key", ""))
            if not key.startswith(key_root):
                continue
            try:
                fs.abort_mpu(bucket, key, up["UploadId"])
            except Exception:
                left.append(f"multipart upload {bucket}/{key}")
        return left


def _shape(exc: BaseException) -> str:
    """How the library reported a refused create-only write (class, errno, HTTP status)."""
    from ckptfs.storage.fsspec import error_chain, status_code

    name = type(exc).__name__
    errno = getattr(exc, "errno", None)
    if errno:
        name += f"(errno {errno})"
    for cur in error_chain(exc):
        status, code = status_code(cur)
        if status or code:
            return f"{name} carrying {' '.join(x for x in (str(status or ''), code) if x)}"
    return name


def run_doctor(url: str, *, threads: int = 8, **storage_options: Any) -> DoctorReport:
    """Run every probe against a fresh prefix of ``url`` and remove what it wrote.

    Raises a typed `StorageError` if the store cannot be reached at all
    (missing bucket, refused credentials, dead endpoint); otherwise every probe's outcome,
    including unexpected errors, is in the report."""
    doc = _Doctor(url, threads, dict(storage_options))
    report = DoctorReport(url=doc.url, probe_url=doc.probe_url,
                          protocol=doc.caps.protocol, capabilities=asdict(doc.caps))
    probes: list[Callable[[], Check]] = [
        doc.exclusive_create, doc.create_race, doc.listing_fresh, doc.delete_visible,
        doc.ranged_read, doc.exclusive_multipart, doc.empty_create]
    try:
        for probe in probes:
            try:
                report.checks.append(probe())
            except Exception as exc:
                name = probe.__name__
                report.checks.append(Check(name, name.replace("_", " "),
                                           name not in ("exclusive_multipart", "empty_create"),
                                           "error", "-", describe_cause(exc),
                                           "could not be checked"))
    finally:
        report.leftovers = doc.cleanup()
    return report


def cmd_doctor(args: argparse.Namespace) -> int:
    from ckptfs.cli.core import EXIT_FAILED, EXIT_OK, emit, parse_options

    report = run_doctor(args.url, threads=args.threads, **parse_options(args.option))
    emit(args, report.as_dict(), report.render())
    return EXIT_OK if report.ok else EXIT_FAILED


def add_subcommands(subparsers: Any) -> None:
    from ckptfs.cli.core import add_store_args, int_option

    p = subparsers.add_parser(
        "doctor", help="check that a store gives the guarantees ckptfs relies on",
        description="Probe a store under a fresh prefix of URL (removed afterwards): "
        "create-only writes, racing creators, listing and delete visibility, ranged reads. "
        "Exit status 1 if a guarantee the commit protocol needs is missing.")
    add_store_args(p)
    p.add_argument("--threads", type=int_option(2, 64), default=8,
                   help="racing clients, 2 to 64 (default 8)")
    p.set_defaults(func=cmd_doctor)
