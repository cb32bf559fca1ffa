"""Hostile incremental checkpoints (format v3): the references of a v3 manifest turned against
the reader.  A donor run holds two v3 checkpoints (step 1 references step 0's model, as the
``v3`` write path saves them); each hostile checkpoint is step 1's own files and references,
planted under a new step with a *valid* marker, one thing changed.  Where the attacker controls
them the digests are valid (chunk lists re-hashed, a referenced file rewritten in an attempt of
the planted step with its chunks re-hashed), so only the reader's own checks can refuse it.  The
expected error of each (`EXPECTED_ERRORS`) is the one its v1/v2 counterpart
gets: a path trick is `UnsafeCheckpointError`, the rest
`CorruptCheckpointError`.
"""

from __future__ import annotations

import copy
import json
import os
import struct
from collections.abc import Callable
from typing import Any, cast

import msgpack

from ckptfs.format.hashing import digest_bytes
from ckptfs.format.layout import StepPaths, new_attempt_name
from ckptfs.format.manifest import Marker
from ckptfs.format.sharded import Chunk, chunk_list_digest
from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability.common import raw_storage, store_on
from ckptfs.testing.reliability.paths import V3

#: The donor checkpoint's first reference (``model/w``'s file in step 0) and its state slot.
REF = "ref-00000.safetensors"
TENSOR = "model/w"


def packb(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]


class PlanterV3:
    """Writes hostile v3 checkpoints through the backdoor, each with a valid marker: step 1 of
    the donor run (its own files, their chunk tables re-hashed, and its references to step 0),
    with what a case changes.  ``side``: files written into another attempt of the planted step
    (what a case's reference may point at; removed with the step)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        donor = store_on(raw_storage(backend))
        V3.save(donor, 0, V3.state(0))
        info = V3.save(donor, 1, V3.state(1))
        self.algorithm = info.manifest.hash_algorithm
        self.doc = json.loads(backend.raw_read(f"{info.path}/MANIFEST.json"))
        if not self.doc["references"]:  # pragma: no cover - the v3 path references step 0
            raise AssertionError("the donor checkpoint references nothing")
        self.files = {e.path: backend.raw_read(f"{info.path}/{e.path}")
                      for e in info.manifest.files}
        self.bounds = {e["path"]: [(c[0], c[1]) for c in e["chunks"]]
                       for e in self.doc["files"]}
        self.state = msgpack.unpackb(self.files["state.msgpack"], raw=False)
        self.step = 1000
        #: The attempt of the planted step that ``plant(side=...)`` wrote (for ``doc_edit``).
        self.side_attempt = ""

    def hexd(self, data: bytes) -> str:
        return digest_bytes(self.algorithm, data).split(":", 1)[1]

    def entry(self, path: str, data: bytes) -> dict[str, Any]:
        bounds = self.bounds.get(path)
        if bounds is None or sum(n for _, n in bounds) != len(data):
            bounds = [(0, len(data))]
        chunks = [Chunk(o, n, self.hexd(data[o:o + n])) for o, n in bounds]
        return {"path": path, "size": len(data), "algorithm": self.algorithm,
                "digest": chunk_list_digest(self.algorithm, chunks),
                "chunks": [[c.offset, c.length, c.digest] for c in chunks]}

    def ref(self, doc: dict[str, Any], path: str = REF) -> dict[str, Any]:
        return cast(dict[str, Any], next(r for r in doc["references"] if r["path"] == path))

    def source_bytes(self, ref: dict[str, Any]) -> bytes:
        """The bytes of the donor file a reference names."""
        rel = f"checkpoints/{StepPaths(ref['step']).dir_name}/{ref['attempt']}/{ref['source']}"
        return self.backend.raw_read(rel)

    def plant(self, *, files: dict[str, bytes] | None = None,
              side: dict[str, bytes] | None = None,
              doc_edit: Callable[[dict[str, Any]], None] | None = None,
              after: Callable[[int, str], None] | None = None) -> int:
        self.step += 1
        step = self.step
        files = dict(self.files if files is None else files)
        attempt = new_attempt_name()
        adir = StepPaths(step).attempt_dir(attempt)
        for rel, data in files.items():
            self.backend.raw_write(f"{adir}/{rel}", data)
        self.side_attempt = new_attempt_name()
        while self.side_attempt == attempt:  # pragma: no cover - names are random
            self.side_attempt = new_attempt_name()
        for rel, data in (side or {}).items():
            self.backend.raw_write(f"{StepPaths(step).attempt_dir(self.side_attempt)}/{rel}",
                                   data)
        doc = copy.deepcopy(self.doc)
        doc.update(step=step, attempt=attempt,
                   files=[self.entry(p, d) for p, d in files.items()])
        if doc_edit is not None:
            doc_edit(doc)
        mbytes = json.dumps(doc).encode()
        self.backend.raw_write(f"{adir}/MANIFEST.json", mbytes)
        if after is not None:
            after(step, attempt)
        marker = Marker(step, attempt, digest_bytes("sha256", mbytes), len(mbytes),
                        "2026-01-01T00:00:00+00:00", {})
        self.backend.raw_write(StepPaths(step).marker, marker.to_bytes())
        return step


def _header(blob: bytes) -> tuple[int, dict[str, Any]]:
    (hlen,) = struct.unpack("<Q", blob[:8])
    return hlen, json.loads(blob[8:8 + hlen])


def hostile_v3_cases(pl: PlanterV3, sentinel: str, *, local: bool
                     ) -> list[tuple[str, Callable[[], int], str]]:
    """(name, plant -> step, expected) for every hostile v3 input (module docstring).  Nothing
    is read from ``pl`` until a case is planted (`hostile_v3_names`)."""
    cases: list[tuple[str, Callable[[], int], str]] = []

    def add(name: str, fn: Callable[[], int], expected: str = "typed") -> None:
        cases.append((name, fn, expected))

    def ref_edit(edit: Callable[[dict[str, Any]], None], path: str = REF
                 ) -> Callable[[], int]:
        return lambda: pl.plant(doc_edit=lambda d: edit(pl.ref(d, path)))

    def ref_set(**change: Any) -> Callable[[], int]:
        return ref_edit(lambda r: r.update(change))

    def chunks_set(make: Callable[[list[list[Any]]], list[list[Any]]]) -> Callable[[], int]:
        return ref_edit(lambda r: r.update(chunks=make(r["chunks"])))

    # -- where a reference points ----------------------------------------------------------------
    for source in ["../../secret.bin", "a/../../../secret.bin", "/etc/passwd", "..",
                   "s3://other-bucket/key", "file:///etc/passwd", "%2e%2e/x", "a\\..\\x", "",
                   "MANIFEST.json", "COMPLETE", "state.msgpack"]:
        add(f"reference source {source[:40]!r}", ref_set(source=source), "unsafe")
    for attempt in ["../../x", "..", "a-evil", "", "a-20260101T000000Z-0123456789abcdef/..",
                    "step-000000000000"]:
        add(f"reference attempt {attempt!r} (not an attempt name)", ref_set(attempt=attempt),
            "unsafe")
    add("reference attempt is an int", ref_set(attempt=7), "unsafe")
    for path in ["../ref.safetensors", "/etc/passwd", "MANIFEST.json", "COMPLETE"]:
        add(f"reference path {path!r}", ref_set(path=path), "unsafe")
    add("reference path colliding with a file of the attempt",
        ref_set(path="tensors-00000.safetensors"), "unsafe")
    add("reference path colliding with state.msgpack", ref_set(path="state.msgpack"), "unsafe")
    add("two references with the same path", lambda: pl.plant(doc_edit=lambda d: d[
        "references"].append(copy.deepcopy(d["references"][0]))), "unsafe")
    add("reference to its own attempt",
        lambda: pl.plant(doc_edit=lambda d: pl.ref(d).update(step=d["step"],
                                                             attempt=d["attempt"])))
    for step in [-1, True, 1.0, "0", 1 << 60]:
        add(f"reference step {step!r}", ref_set(step=step))
    add("reference to a step with no such file", ref_set(step=999_999))
    add("reference to a reference (the donor's ref-00000.safetensors)",
        lambda: pl.plant(doc_edit=lambda d: pl.ref(d).update(
            step=1, attempt=pl.doc["attempt"], source=REF)))

    # -- sizes and chunks ------------------------------------------------------------------------
    def stretched(size: int) -> Callable[[], int]:
        """Declared ``size`` B, its last chunk stretched to the end (inside the size)."""
        def edit(r: dict[str, Any]) -> None:
            last = r["chunks"][-1]
            last[1] += size - r["size"]
            r["size"] = size
        return ref_edit(edit)

    add("reference size 2^60", ref_set(size=1 << 60))
    add("reference size 2^45, its last chunk stretched to it", stretched(1 << 45))
    add("reference size 1 PiB, its last chunk stretched to it", stretched(1 << 50))
    for size in [-1, True, 1.5, "12", None]:
        add(f"reference size {size!r}", ref_set(size=size))
    add("reference size 1 B smaller than the file", ref_edit(lambda r: r.update(
        size=r["size"] - 1, chunks=[r["chunks"][0]])))
    add("reference chunks overlapping", chunks_set(lambda c: [c[0], [c[0][1] - 4, *c[1][1:]]]))
    add("reference chunks out of order", chunks_set(lambda c: [c[0], c[1], c[1]]))
    add("reference chunks in reverse order", chunks_set(lambda c: [c[1], c[0]]))
    add("reference chunk outside the file",
        chunks_set(lambda c: [c[0], [c[1][0] + 8, *c[1][1:]]]))
    add("reference chunk of negative length", chunks_set(lambda c: [c[0], [c[1][0], -1,
                                                                           c[1][2]]]))
    add("reference with no chunks", chunks_set(lambda c: []))
    add("reference's first chunk is not the header (offset 8)",
        chunks_set(lambda c: [[8, c[0][1] - 8, c[0][2]], c[1]]))
    add("reference's first chunk is not the whole header",
        chunks_set(lambda c: [[0, 64, c[0][2]], c[1]]))
    add("reference's header chunk of 2^40 B", ref_edit(lambda r: r.update(
        size=(1 << 40) + 64, chunks=[[0, 1 << 40, r["chunks"][0][2]], [1 << 40, 64,
                                                                       r["chunks"][1][2]]])))
    add("reference chunk is not [offset, length, hex]",
        chunks_set(lambda c: [c[0], [*c[1], 0]]))
    add("reference chunk digest not hex", chunks_set(lambda c: [c[0], [*c[1][:2], "zz"]]))
    add("reference algorithm unknown", ref_set(algorithm="md5"))
    def lacking(key: str) -> Callable[[dict[str, Any]], None]:
        return lambda r: r.pop(key)

    for key in ["path", "step", "attempt", "source", "size", "algorithm", "chunks"]:
        add(f"reference lacks {key!r}", ref_edit(lacking(key)))
    add("references is not a list",
        lambda: pl.plant(doc_edit=lambda d: d.update(references={"a": 1})))
    add("a reference is not an object",
        lambda: pl.plant(doc_edit=lambda d: d.update(references=[[1, 2]])))
    add("manifest without references", lambda: pl.plant(doc_edit=lambda d: d.pop("references")))
    add("format version 3 with layout 'sharded'",
        lambda: pl.plant(doc_edit=lambda d: d.update(layout="sharded")))

    # -- the referenced file's header: digest valid, contents not what the state says -------------
    def rewritten(edit: Callable[[dict[str, Any]], None], *, hlen_to: int | None = None
                  ) -> Callable[[], int]:
        """The referenced file copied into another attempt of the planted step with its header
        edited (same length) and the reference pointed there, every chunk re-hashed."""
        def build() -> int:
            ref = pl.ref(pl.doc)
            blob = pl.source_bytes(ref)
            hlen, h = _header(blob)
            edit(h)
            text = json.dumps(h, separators=(",", ":")).encode()
            assert len(text) <= hlen, "the edited header must fit"
            text += b" " * (hlen - len(text))
            new = struct.pack("<Q", hlen if hlen_to is None else hlen_to) + text + \
                blob[8 + hlen:]

            def point(d: dict[str, Any]) -> None:
                r = pl.ref(d)
                r.update(step=d["step"], attempt=pl.side_attempt,
                         chunks=[[o, n, pl.hexd(new[o:o + n])] for o, n, _ in r["chunks"]])
            return pl.plant(side={ref["source"]: new}, doc_edit=point)
        return build

    def tensor(edit: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
        return lambda h: edit(h[TENSOR])

    add("referenced header dtype differs from the state (digest valid)",
        rewritten(tensor(lambda e: e.update(dtype="I32"))))
    add("referenced header shape differs from the state (digest valid)",
        rewritten(tensor(lambda e: e.update(shape=[16]))))
    add("referenced header shape [2, 8] (same bytes, digest valid)",
        rewritten(tensor(lambda e: e.update(shape=[2, 8]))))
    add("referenced header offsets not the bound chunk (digest valid)",
        rewritten(tensor(lambda e: e.update(data_offsets=[0, 32], shape=[8]))))
    add("referenced header names the tensor differently (digest valid)",
        rewritten(lambda h: h.update({"model/v": h.pop(TENSOR)})))
    add("referenced header dtype 'PICKLE' (digest valid)",
        rewritten(tensor(lambda e: e.update(dtype="PICKLE"))))
    add("referenced header length 2^60 (digest valid)", rewritten(lambda h: None,
                                                                 hlen_to=1 << 60))
    add("referenced header length shorter than its chunk (digest valid)",
        rewritten(lambda h: None, hlen_to=8))

    # -- state.msgpack's slots -------------------------------------------------------------------
    def slot_edit(edit: Callable[[list[Any]], None]) -> Callable[[], int]:
        def build() -> int:
            state = copy.deepcopy(pl.state)
            for slot in state["tensors"]:
                if slot[0] == REF:
                    edit(slot)
            return pl.plant(files={**pl.files, "state.msgpack": packb(state)})
        return build

    add("state slot naming a tensor the reference does not bind (its chunk dropped)",
        chunks_set(lambda c: [c[0]]))
    add("state slot naming a tensor absent from the referenced file",
        slot_edit(lambda s: s.__setitem__(1, "optimizer/exp_avg")))
    add("state slot naming a reference not in the manifest",
        slot_edit(lambda s: s.__setitem__(0, "ref-00099.safetensors")))
    add("state slot dtype differs from the referenced header",
        slot_edit(lambda s: s.__setitem__(2, "I32")))
    add("state slot shape differs from the referenced header",
        slot_edit(lambda s: s.__setitem__(3, [16])))
    add("state slot naming '../ref-00000.safetensors'",
        slot_edit(lambda s: s.__setitem__(0, "../" + REF)), "unsafe")

    if local:
        def linked(what: str) -> Callable[[], int]:
            """The referenced file (or its attempt directory) a symbolic link to a copy outside
            the root (same bytes, so only the link check can refuse it)."""
            def build() -> int:
                ref = pl.ref(pl.doc)
                blob = pl.source_bytes(ref)
                outside = f"{sentinel}.{what}"

                def link(step: int, attempt: str) -> None:
                    adir = os.path.join(pl.backend.raw_root, *StepPaths(step).attempt_dir(
                        pl.side_attempt).split("/"))
                    if what == "file":
                        os.makedirs(adir, exist_ok=True)
                        with open(outside, "wb") as fh:
                            fh.write(blob)
                        os.symlink(outside, os.path.join(adir, ref["source"]))
                    else:
                        os.makedirs(outside, exist_ok=True)
                        with open(os.path.join(outside, ref["source"]), "wb") as fh:
                            fh.write(blob)
                        os.symlink(outside, adir)

                return pl.plant(doc_edit=lambda d: pl.ref(d).update(
                    step=d["step"], attempt=pl.side_attempt), after=link)
            return build

        add("referenced file is a symlink to a file outside the root", linked("file"),
            "unsafe")
        add("referenced attempt directory is a symlink", linked("dir"), "unsafe")
    return cases


def mismatched_v3_cases(pl: PlanterV3) -> list[tuple[str, Callable[[], int]]]:
    """References whose digests do not match the bytes they bind (what a corrupted or forged
    manifest gives): ``load(verify=False)`` reads them as they are, as it reads a corrupted
    file; every verifying reader (load, verify, ``ckptfs cp``, inspect's check) must refuse them
    with `CorruptCheckpointError`."""
    def chunks_set(make: Callable[[list[list[Any]]], list[list[Any]]]) -> Callable[[], int]:
        return lambda: pl.plant(doc_edit=lambda d: pl.ref(d).update(
            chunks=make(pl.ref(d)["chunks"])))

    return [
        ("reference chunk digest is another chunk's",
         chunks_set(lambda c: [c[0], [*c[1][:2], c[0][2]]])),
        ("reference header digest is another chunk's",
         chunks_set(lambda c: [[*c[0][:2], c[1][2]], c[1]])),
        ("reference algorithm not the one its digests were made with",
         lambda: pl.plant(doc_edit=lambda d: pl.ref(d).update(
             algorithm="sha256" if pl.algorithm != "sha256" else "blake3"))),
    ]


def hostile_v3_names(*, local: bool) -> list[tuple[str, str]]:
    """(name, expected) of every case of `hostile_v3_cases`, without planting any."""
    return [(name, expected) for name, _, expected in
            hostile_v3_cases(cast(PlanterV3, None), "", local=local)]
