"""The format table, I/O half: one ``load`` and one ``verify`` per layout, chosen by the
manifest's features (``"sharded"`` or not), and the one dispatch every reader goes through
(``CheckpointStore.load``/``verify``, the CLI, the manager, the integrations).

=============  ===================================  ==========================================
features       load                                 full verify (after the shared listing)
=============  ===================================  ==========================================
not sharded    `ckptfs.protocol.reader.load_single_process`     every file re-read and re-hashed
(v1, v3)
sharded        `ckptfs.protocol.sharded.            every chunk re-read and checked,
(v2, v4)       load_sharded` (imported only then: DCP    ``dcp.msgpack`` and every value document
               costs ~1 s to import)                decoded
=============  ===================================  ==========================================

With ``"references"`` (v3, v4) the same reader reads a reference's chunks where they are
stored (docs/protocol.md §9, §9.6).

A third column, ``check`` (`check_checkpoint`), refuses what a load would refuse without
reading tensor data (every document decoded, every tensor file's header or chunk table checked
against it): ``ckptfs cp`` runs it before copying, so a copy never commits, at its destination,
a checkpoint that a reader of the source refuses.

What every version shares lives here, once: the options are checked before any I/O
(``map_location`` in every ``torch.load`` form, ``keys``, ``mmap``), the listing checks
(`ckptfs.protocol.listing`: links, missing, resized, stray), and ``map_location`` is applied
by one implementation (`ckptfs.protocol.load_options.tensor_map`).  The pure half of the
table (which versions exist, how each manifest decodes, which documents a reader bounds) is
`ckptfs.format.versions`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError
from ckptfs.format.incremental import references_of
from ckptfs.format.limits import MAX_DEPTH
from ckptfs.format.sharded_metadata import DcpDocument
from ckptfs.format.versions import FEATURES, SHARDED, features, has_rank_metadata
from ckptfs.protocol.listing import check_listing, listing_report
from ckptfs.protocol.load_options import KeyPath, MapLocation, parse_keys, tensor_map
from ckptfs.protocol.reader import (
    VerifyReport,
    check_mmap_storage,
    check_single_process,
    load_single_process,
    verify_single_process,
)
from ckptfs.protocol.resolve import CheckpointInfo, check_still_committed, storage_url
from ckptfs.storage.base import Storage

Loader = Callable[..., dict[Any, Any]]
Verifier = Callable[..., None]
Checker = Callable[[Storage, CheckpointInfo], Any]


@dataclass(frozen=True)
class FormatOps:
    """How the checkpoints of one layout are loaded, fully verified, and checked without their
    tensor data (`check_checkpoint`)."""

    layout: str
    load: Callable[[], Loader]
    verify: Callable[[], Verifier]
    check: Callable[[], Checker]


def _sharded_load() -> Loader:
    from ckptfs.protocol.sharded import load_sharded

    return cast(Loader, load_sharded)


def _sharded_verify() -> Verifier:
    from ckptfs.protocol.sharded import verify_sharded

    return cast(Verifier, verify_sharded)


def _sharded_check() -> Checker:
    return check_sharded


def check_sharded(storage: Storage, info: CheckpointInfo) -> DcpDocument:
    """The ``check`` of the sharded layout (v2, v4): the listing, ``dcp.msgpack`` (read,
    chunk digests checked, decoded; every item a chunk of a listed file), every rank file's
    safetensors header (its header chunk read, digest checked, and checked against
    ``dcp.msgpack``, as a load checks it before using any item of the file), every stored
    value document (read, checked, decoded: never unpickled), and the stored tree rebuilt
    over the stored keys, as `ckptfs.protocol.sharded.load_full` rebuilds it.  Values of
    types not registered in this process are checked as plain dicts."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from ckptfs.format.extensions import unregistered_as_dict
    from ckptfs.format.sharded import METADATA_NAME, decode_value
    from ckptfs.format.sharded_metadata import check_rank_header, items_by_file
    from ckptfs.format.sharded_tree import restore
    from ckptfs.protocol.chunks import entry_location, read_chunks
    from ckptfs.protocol.sharded_read import read_document, sharded_manifest

    manifest = sharded_manifest(info)
    check_listing(storage, info)
    doc = read_document(storage, info)
    where = storage_url(storage, info.path)
    by_file = items_by_file(doc)
    paths = [e.path for e in manifest.files] + [r.path for r in references_of(manifest)]
    for path in paths:
        if path == METADATA_NAME or not path.endswith(".safetensors"):
            continue  # dcp.msgpack; format v5's spec, table blocks and index documents
        rank_file = manifest.chunked(path)
        head = read_chunks(storage, info, rank_file, 0, rank_file.chunks[0].length)
        check_rank_header(head, rank_file, by_file.get(path, []),
                          where=storage_url(storage, entry_location(info, rank_file)))
    md = doc.metadata
    with unregistered_as_dict():
        for index, loc in sorted((md.storage_data or {}).items(),
                                 key=lambda kv: (kv[1].path, kv[1].offset)):
            if isinstance(md.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
                view = read_chunks(storage, info, manifest.chunked(loc.path), loc.offset,
                                   loc.length)
                decode_value(view, where=f"stored value {index.fqn!r}")
    if doc.tree is not None:
        state = restore(doc.tree, _stored_view(doc.tree, where), where=where)
        if not isinstance(state, dict):
            raise CorruptCheckpointError(f"{where}: the state root is not a dict",
                                         step=info.step)
    return doc


def _stored_view(tree: Any, where: str) -> Any:
    """What a full load hands `restore`, for a checkpoint
    holding every value its tree names (placeholders: no value is read)."""
    from ckptfs.format.serialize import build_tree

    def fill(node: Any, depth: int) -> Any:
        if depth > MAX_DEPTH or not (isinstance(node, list) and len(node) == 2
                                     and isinstance(node[1], list)):
            return None  # restore refuses it, with its own error
        tag, payload = node
        if tag == "d":
            return {str(build_tree(item[0], [], where=where)): fill(item[1], depth + 1)
                    for item in payload if isinstance(item, list) and len(item) == 2}
        if tag in ("l", "t"):
            return [fill(c, depth + 1) for c in payload]
        return None

    return fill(tree, 0)


#: The single-process reader (v1; v3 too: v1's state and tensor files, chunked, with
#: references) and the sharded one (v2; v4 too: v2 with references).
SINGLE_PROCESS_READER = FormatOps("single-process", lambda: load_single_process,
                                  lambda: verify_single_process, lambda: check_single_process)
SHARDED_READER = FormatOps("sharded", _sharded_load, _sharded_verify, _sharded_check)
#: Per format version this ckptfs reads, its reader (by its features).
FORMATS: dict[int, FormatOps] = {
    version: SHARDED_READER if SHARDED in feats else SINGLE_PROCESS_READER
    for version, feats in FEATURES.items()
}


def ops_for(info: CheckpointInfo) -> FormatOps:
    """The reader of ``info``'s layout: sharded or not (its manifest's features)."""
    return SHARDED_READER if SHARDED in features(info.manifest) else SINGLE_PROCESS_READER


def load_checkpoint(storage: Storage, info: CheckpointInfo, *, verify: bool = True,
                    map_location: MapLocation = None, threads: int = 4,
                    keys: Iterable[str | KeyPath] | None = None,
                    mmap: bool = False) -> dict[Any, Any]:
    """Load a committed checkpoint of any format version (docs/loading.md).

    ``keys``: load only these key paths (a damaged file holding none of them does not stop the
    load).  ``map_location``: as ``torch.load``.  ``mmap``: local disk, format v1: tensors view
    copy-on-write mappings of the files instead of buffers read into memory."""
    mapper = tensor_map(map_location)  # bad options fail before any I/O
    paths = parse_keys(keys)
    if mmap:
        check_mmap_storage(storage, info)
    return ops_for(info).load()(storage, info, verify=verify, mapper=mapper, threads=threads,
                                keys=paths, mmap=mmap)


def verify_checkpoint(storage: Storage, info: CheckpointInfo, *, quick: bool = False,
                      threads: int = 4) -> VerifyReport:
    """Check a committed checkpoint against its manifest.

    quick: the listing checks only (links, missing, resized, stray files).  full: also the
    format's own checks (every byte re-read and re-hashed).  Problems are collected (all of
    them, naming each file) in the report; the caller decides whether to raise."""
    report = VerifyReport(info.step, info.attempt, info.url, "quick" if quick else "full")
    try:
        info = _expanded(storage, info)
    except CorruptCheckpointError as exc:  # a table block or an index document
        report.problems = [str(exc)]
        report.unsafe = [str(exc)] if isinstance(exc, UnsafeCheckpointError) else []
        report.files = len(info.manifest.files)
        report.bytes = info.manifest.total_bytes
        return report
    _, found = listing_report(storage, info)
    report.problems = [p.text for p in found]
    report.unsafe = [p.text for p in found if p.kind == "link"]
    report.files = len(info.manifest.files)
    report.bytes = info.manifest.total_bytes
    if not quick and not report.unsafe:
        ops_for(info).verify()(storage, info, report, threads=threads)
    return report


def verified(storage: Storage, info: CheckpointInfo, *, quick: bool = False,
             threads: int = 4) -> VerifyReport:
    """`verify_checkpoint`, raising if the copy fails: `CorruptCheckpointError`
    (`UnsafeCheckpointError` for a link) listing every problem, or
    `CheckpointDeletedError` if the step was deleted or replaced while it was verified
    (``store.verify``'s check of one copy)."""
    report = verify_checkpoint(storage, info, quick=quick, threads=threads)
    if not report.ok:
        check_still_committed(storage, info.step, info.dir_name, info.attempt)
        cls = UnsafeCheckpointError if report.unsafe else CorruptCheckpointError
        raise cls(f"step {info.step} at {info.url} fails {report.mode} verification: "
                  + "; ".join(report.problems), step=info.step, path=info.path)
    return report


def check_checkpoint(storage: Storage, info: CheckpointInfo) -> Any:
    """Raise what a load of ``info`` would raise (the same typed error), reading every document
    and every tensor file's header but no tensor data.  What it cannot know: the bytes of the
    tensors (their digests are checked by whoever reads them: a load, a verify, a copy).
    Returns what the version's check decoded (v1: `CheckedSingleProcess`;
    v2: the `DcpDocument`), for ``ckptfs inspect``."""
    return ops_for(info).check()(storage, _expanded(storage, info))


def _expanded(storage: Storage, info: CheckpointInfo) -> CheckpointInfo:
    """``info`` with every rank file of a format v5 checkpoint in its manifest (its table and
    every index document read and checked), so the listing and the checks see every file."""
    if not has_rank_metadata(info.manifest):
        return info
    from ckptfs.protocol.rank_metadata import expand  # imports DCP: sharded checkpoints only

    return expand(storage, info)


__all__ = ["FORMATS", "SHARDED_READER", "SINGLE_PROCESS_READER", "FormatOps", "VerifyReport",
           "check_checkpoint", "check_listing", "load_checkpoint", "ops_for",
           "verified", "verify_checkpoint"]
