"""Corruption matrix: every file of a committed checkpoint flipped, truncated, extended, deleted
or swapped, stray files added, the manifest replaced and the marker edited; full verify and
``load(verify=True)`` must detect every one, never returning wrong data."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from ckptfs.errors import CkptfsError, CorruptCheckpointError, FormatVersionError
from ckptfs.format.incremental import references_of
from ckptfs.format.layout import StepPaths
from ckptfs.format.versions import SHARDED, features, has_rank_metadata
from ckptfs.protocol.rank_metadata import expand
from ckptfs.protocol.resolve import read_committed
from ckptfs.testing.backend import Backend
from ckptfs.testing.reliability.common import (
    Sweep,
    raw_storage,
    scenario_guard,
    states_equal,
    store_on,
)
from ckptfs.testing.reliability.paths import (
    V1,
    WritePath,
    read_part,
    rollback_read,
    rollback_reads,
)


def _flip(data: bytes, pos: int, bit: int = 0) -> bytes:
    b = bytearray(data)
    b[pos] ^= 1 << bit
    return bytes(b)


def corruption_matrix(backend: Backend, *, marker_byte_sweep: bool | None = None,
                      path: WritePath = V1) -> Sweep:
    """Every file of a committed checkpoint (state.msgpack, each safetensors file, MANIFEST.json,
    COMPLETE; format v2: dcp.msgpack and each rank's file; format v5: the spec, the table's
    blocks, each rank's file and index document) flipped, truncated, extended,
    deleted, swapped with another checkpoint's; a stray file added; the manifest replaced by
    another checkpoint's; the marker edited field by field.  Full verify and
    ``load(verify=True)`` must detect every one, naming the file; quick verify every size or
    inventory change.  With ``marker_byte_sweep`` every byte of the marker is also flipped: each
    flip must be detected or provably harmless (the marker still parses and binds the same step,
    attempt and manifest digest).  ``path``: how both checkpoints are written (`.paths`);
    with references (format v3), the damaged checkpoint reads its model from a file of the older
    one, and that file is damaged too: a flipped byte in a tensor chunk and in the header chunk
    it references, the file truncated, extended, deleted."""
    backend = path.at(backend)
    sweep = Sweep(backend.name, "corruption" if path is V1 else f"corruption ({path.name})")
    if marker_byte_sweep is None:
        marker_byte_sweep = backend.protocol in ("file", "memory")
    state = path.state
    store = store_on(raw_storage(backend))
    path.save(store, 1, state(1))
    path.save(store, 2, state(2))
    t_step, o_step = 2, 1  # damage the newest, so "latest" meets the damage
    info1, info2 = store.info(t_step), store.info(o_step)
    pristine = {rel: backend.raw_read(rel) for rel in backend.raw_files(StepPaths(t_step).dir)}
    marker_rel = StepPaths(t_step).marker
    manifest_rel = f"{info1.path}/MANIFEST.json"
    other_manifest = backend.raw_read(f"{info2.path}/MANIFEST.json")
    other_marker = backend.raw_read(StepPaths(o_step).marker)

    def restore(rels: list[str]) -> None:
        for rel in rels:
            if rel in pristine:
                backend.raw_write(rel, pristine[rel])
            elif backend.raw_exists(rel):
                backend.raw_delete(rel)

    def marker_doc(**change: Any) -> bytes:
        doc = json.loads(pristine[marker_rel])
        doc.update(change)
        return (json.dumps(doc, sort_keys=True) + "\n").encode()

    cases: list[tuple[str, str, Callable[[], None], bool]] = []  # name, file, mutate, sized

    def add(name: str, rel: str, mutate: Callable[[], None], sized: bool) -> None:
        cases.append((name, rel, mutate, sized))

    def put(rel: str, data: bytes) -> Callable[[], None]:
        return lambda: backend.raw_write(rel, data)

    def remove(rel: str) -> Callable[[], None]:
        return lambda: backend.raw_delete(rel)

    # Every file the checkpoint holds: with the "rank-metadata" feature (format v5) the rank
    # files and their index documents are found through the table, not listed in the manifest.
    view = expand(store.storage, info1) if has_rank_metadata(info1.manifest) else info1
    relpaths = [e.path for e in view.manifest.files] + ["MANIFEST.json"]
    for relpath in relpaths:
        rel = f"{info1.path}/{relpath}"
        data = pristine[rel]
        for pos_name, pos in (("first", 0), ("middle", len(data) // 2), ("last", len(data) - 1)):
            add(f"flip {pos_name} byte of {relpath}", rel, put(rel, _flip(data, pos)), False)
        add(f"truncate {relpath} by 1 byte", rel, put(rel, data[:-1]), True)
        add(f"truncate {relpath} to half", rel, put(rel, data[:len(data) // 2]), True)
        add(f"extend {relpath} by 1 byte", rel, put(rel, data + b"\0"), True)
        add(f"delete {relpath}", rel, remove(rel), True)
        other = backend.raw_read(f"{info2.path}/{relpath}")
        add(f"replace {relpath} with step {o_step}'s", rel, put(rel, other),
            len(other) != len(data))
    tensor_file = next(e.path for e in view.manifest.files if e.path.endswith(".safetensors"))
    stray_tensors = ("rank-00099/data-0.safetensors" if SHARDED in features(info1.manifest)
                     else "tensors-99999.safetensors")
    add("stray file in the attempt", f"{info1.path}/stray.bin",
        lambda: backend.raw_write(f"{info1.path}/stray.bin", b"junk"), True)
    add("stray safetensors in the attempt", f"{info1.path}/{stray_tensors}",
        lambda: backend.raw_write(f"{info1.path}/{stray_tensors}",
                                  pristine[f"{info1.path}/{tensor_file}"]), True)
    add("manifest replaced by another checkpoint's", manifest_rel,
        lambda: backend.raw_write(manifest_rel, other_manifest), False)
    def swap_pair() -> None:
        backend.raw_write(manifest_rel, other_manifest)
        backend.raw_write(marker_rel, other_marker)

    add("marker and manifest replaced by another checkpoint's", marker_rel, swap_pair, False)
    other_digest = json.loads(other_marker)["manifest_digest"]
    edits = {"manifest_digest": other_digest, "attempt": info2.attempt, "step": o_step,
             "manifest_size": json.loads(pristine[marker_rel])["manifest_size"] + 1,
             "format_version": 99, "schema": "other"}
    for key, value in edits.items():
        add(f"marker {key} edited", marker_rel, put(marker_rel, marker_doc(**{key: value})),
            False)
    mdata = pristine[marker_rel]
    add("marker truncated", marker_rel,
        lambda: backend.raw_write(marker_rel, mdata[:len(mdata) // 2]), False)
    add("marker extended", marker_rel, lambda: backend.raw_write(marker_rel, mdata + b"x"), False)
    add("marker emptied", marker_rel, lambda: backend.raw_write(marker_rel, b""), False)

    refs = references_of(info1.manifest)
    if path.references and not refs:
        sweep.bad("setup", f"step {t_step} references nothing: the v3 cases cannot run")
    for ref in refs:  # the older checkpoint's file the damaged one reads its model from
        rel = ref.location
        data = pristine[rel] = backend.raw_read(rel)
        head, tensor = ref.chunks[0], ref.chunks[-1]
        sweep.count("referenced_files")
        add(f"flip a byte of {ref.path}'s tensor chunk in {rel}", rel,
            put(rel, _flip(data, tensor.offset + tensor.length // 2)), False)
        add(f"flip a byte of {ref.path}'s header chunk in {rel}", rel,
            put(rel, _flip(data, head.length // 2)), False)
        add(f"flip the header length of {ref.path}'s header chunk in {rel}", rel,
            put(rel, _flip(data, 0)), False)
        add(f"truncate {rel} ({ref.path}) by 1 byte", rel, put(rel, data[:-1]), True)
        add(f"truncate {rel} ({ref.path}) to its header", rel, put(rel, data[:head.length]),
            True)
        add(f"extend {rel} ({ref.path}) by 1 byte", rel, put(rel, data + b"\0"), True)
        add(f"delete {rel} ({ref.path})", rel, remove(rel), True)

    quick_tried = quick_detected = load_detected = 0
    reader = backend.open()
    for name, rel, mutate, sized in cases:
        sweep.tried += 1
        # the file as named inside the attempt (rank-00000/data-0.safetensors), or its name
        base = rel.removeprefix(info1.path + "/").rsplit("/", 1)[-1] if rel == marker_rel \
            else rel.removeprefix(info1.path + "/")
        mutate()
        stray = "stray" in name
        # full verify
        try:
            reader.verify(t_step)
            sweep.bad(name, "full verify passed")
        except CkptfsError as exc:
            if base not in str(exc):
                sweep.bad(name, f"full verify does not name {base}: {exc}")
            else:
                sweep.count("detected")
        except Exception as exc:
            sweep.bad(name, f"full verify raised untyped {type(exc).__name__}: {exc}")
        # load
        try:
            loaded = reader.load(t_step, verify=True)
            if stray and states_equal(loaded, state(t_step)):
                sweep.count("load_unaffected_by_stray")  # the files it reads are intact
            else:
                sweep.bad(name, "load(verify=True) returned")
        except CkptfsError as exc:
            if base not in str(exc):
                sweep.bad(name, f"load does not name {base}: {exc}")
            else:
                load_detected += 1
        except Exception as exc:
            sweep.bad(name, f"load raised untyped {type(exc).__name__}: {exc}")
        # no silent rollback: the newest is damaged, so loading "the latest" must raise, never
        # return the older checkpoint (a stray file changes nothing load reads)
        try:
            latest = reader.load()
            if not (stray and states_equal(latest, state(t_step))):
                sweep.bad(name, "load() of the latest returned instead of raising")
        except CorruptCheckpointError:
            sweep.count("latest_raised")
        except Exception as exc:
            sweep.bad(name, f"load() of the latest raised {type(exc).__name__}: {exc}")
        # the rollback reads skip the damaged newest for the previous step (a typed error
        # only when that one is damaged too: a file of it the newest references), and never
        # return damaged bytes
        for how in rollback_reads(path):
            sweep.count("rollback_tried")
            try:
                got = rollback_read(how, reader, state(t_step))
            except FormatVersionError:  # "written by a newer ckptfs": never rolled back over
                sweep.count("rollback_newer_format")
            except CkptfsError as exc:
                if rel.startswith(info1.path + "/") or rel == marker_rel:
                    sweep.bad(name, f"{how} raised instead of rolling back to step {o_step}: "
                              f"{type(exc).__name__}: {exc}")
                else:
                    sweep.count("rollback_raised")
            except Exception as exc:
                sweep.bad(name, f"{how} raised untyped {type(exc).__name__}: {exc}")
            else:
                if states_equal(got, read_part(state(o_step), how)):
                    sweep.count("rollback_previous")
                elif states_equal(got, read_part(state(t_step), how)):
                    sweep.count("rollback_newest_intact")  # the damage is not in what it reads
                else:
                    sweep.bad(name, f"{how} returned neither step {o_step}'s nor step "
                              f"{t_step}'s state")
        if sized:
            quick_tried += 1
            try:
                reader.verify(t_step, quick=True)
                sweep.bad(name, "quick verify missed a size/inventory change")
            except CkptfsError:
                quick_detected += 1
            except Exception as exc:
                sweep.bad(name, f"quick verify raised untyped {type(exc).__name__}: {exc}")
        restore([rel, manifest_rel] if rel == marker_rel else [rel])
    sweep.count("load_detected", load_detected)
    sweep.count("quick_tried", quick_tried)
    sweep.count("quick_detected", quick_detected)

    if marker_byte_sweep:
        reader = store_on(raw_storage(backend))
        for pos in range(len(mdata)):
            sweep.count("marker_flips")
            backend.raw_write(marker_rel, _flip(mdata, pos, bit=pos % 7))
            try:
                got = read_committed(reader.storage, t_step)
                if (got.attempt, got.marker.manifest_digest) != (info1.attempt,
                                                                 info1.marker.manifest_digest):
                    sweep.bad(f"marker byte {pos} flipped", "accepted with different binding")
                sweep.count("marker_flips_harmless")
            except CkptfsError:
                sweep.count("marker_flips_detected")
        restore([marker_rel])
    reader = backend.open()
    with scenario_guard(sweep, "after the matrix"):
        reader.verify(1)
        reader.verify(2)
    return sweep
