"""Helpers of the sharded hardening tests: write a small format v2 checkpoint in one process and
edit it the way an attacker (or a buggy writer) would, then *reseal* it (every chunk digest, file
digest, the manifest and the marker recomputed), so only the edit itself is wrong and the
reader's own checks, not a digest, must catch it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import torch
from dist_util import save_sharded

import ckptfs
from ckptfs.format.layout import StepPaths

RANK_FILE = "rank-00000/data-0.safetensors"


def sharded_state() -> dict[str, Any]:
    """``w`` (6 float32), ``v`` (3 float32: the length of half of ``w``), values, a bf16."""
    return {"w": torch.arange(6, dtype=torch.float32), "v": torch.ones(3),
            "b": torch.ones(2, dtype=torch.bfloat16),
            "trainer": {"step": 20, "lr": 0.5, "names": ["a", "b"]}}


def write_run(root: Path) -> tuple[ckptfs.CheckpointStore, str]:
    """Step 10 (good, v2) and step 20 (v2, to be tampered with); returns its attempt."""
    store = ckptfs.open(str(root), algorithm="sha256")
    save_sharded(store.storage, 10, {**sharded_state(), "trainer": {"step": 10}},
                 algorithm="sha256")
    info = save_sharded(store.storage, 20, sharded_state(), algorithm="sha256")
    return store, info.attempt


def attempt_dir(root: Path, step: int, attempt: str) -> Path:
    return root / StepPaths(step).attempt_dir(attempt)


def _hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def reseal(root: Path, step: int, attempt: str,
           edit_manifest: Callable[[dict[str, Any]], None] | None = None) -> None:
    """Recompute every chunk digest from the stored bytes with sha256 (chunk boundaries kept;
    the one chunk of ``dcp.msgpack`` takes its new size), every file digest, then the
    marker."""
    adir = attempt_dir(root, step, attempt)
    mpath = adir / "MANIFEST.json"
    manifest = json.loads(mpath.read_bytes())
    for f in manifest["files"]:
        p = adir / f["path"]
        data = p.read_bytes() if p.exists() and not p.is_symlink() else b""
        if f["path"] == "dcp.msgpack":
            f["chunks"] = [[0, len(data), ""]]
            f["size"] = len(data)
        for c in f["chunks"]:
            c[2] = _hex(data[c[0]:c[0] + c[1]])
        text = "".join(f"{c[0]} {c[1]} {c[2]}\n" for c in f["chunks"]).encode()
        f["digest"], f["algorithm"] = "sha256:" + _hex(text), "sha256"
    manifest["hash_algorithm"] = "sha256"
    if edit_manifest is not None:
        edit_manifest(manifest)
    mbytes = json.dumps(manifest, sort_keys=True).encode()
    mpath.write_bytes(mbytes)
    marker_path = root / StepPaths(step).marker
    marker = json.loads(marker_path.read_bytes())
    marker["manifest_digest"] = "sha256:" + _hex(mbytes)
    marker["manifest_size"] = len(mbytes)
    marker_path.write_bytes(json.dumps(marker).encode())


def edit_dcp(root: Path, step: int, attempt: str, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Decode ``dcp.msgpack``, apply ``edit`` (returning new bytes, or None to repack the
    edited document), write it back and reseal."""
    path = attempt_dir(root, step, attempt) / "dcp.msgpack"
    doc = msgpack.unpackb(path.read_bytes(), raw=False, strict_map_key=False)
    out = edit(doc)
    path.write_bytes(out if isinstance(out, bytes) else msgpack.packb(doc, use_bin_type=True))
    reseal(root, step, attempt)


def location(doc: dict[str, Any], fqn: str) -> list[Any]:
    """The ``storage_data`` entry of ``fqn`` (its first)."""
    return next(e for e in doc["storage_data"] if e[0] == fqn)


def rank_header(root: Path, step: int, attempt: str) -> tuple[Path, int, dict[str, Any]]:
    """(the rank file, its header length, the header)."""
    path = attempt_dir(root, step, attempt) / RANK_FILE
    data = path.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    return path, hlen, json.loads(data[8:8 + hlen])
