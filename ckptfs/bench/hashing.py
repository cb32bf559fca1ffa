"""The ``hash`` question: throughput of every algorithm, ckptfs's hasher against the raw
library, per chunk size."""

from __future__ import annotations

import os
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

from ckptfs.bench.common import GiB, KiB, MiB, fill_random, fmt_size


def bench_hash(nbytes: int = GiB, *, chunk_sizes: Sequence[int] = (64 * KiB, MiB, 8 * MiB,
                                                                      16 * MiB),
               reps: int = 3, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Throughput of every algorithm: ckptfs's hasher fed chunk by chunk, the raw library fed
    the same chunks, the raw library one-shot over the whole buffer, and the command-line tools
    where installed (they include process start and read the file from the page cache)."""
    import torch

    from ckptfs.format.hashing import ALGORITHMS, new_hasher
    from ckptfs.format.serialize import tensor_memoryview

    data = torch.empty(nbytes, dtype=torch.uint8)
    fill_random([data], 1)
    mv = tensor_memoryview(data)
    raw = _raw_hashers()
    rows: list[dict[str, Any]] = []

    def measure(fn: Callable[[], Any]) -> float:
        ts = []
        for _ in range(reps):  # no memory is first-touched while hashing: no warm-up needed
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts)

    def interleaved(fns: Mapping[str, Callable[[], Any]]) -> dict[str, float]:
        ts: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                ts[k].append(time.perf_counter() - t0)
        return {k: statistics.median(v) for k, v in ts.items()}

    def chunked(make: Callable[[], Any], chunk: int) -> Callable[[], Any]:
        def go() -> Any:
            h = make()
            for off in range(0, nbytes, chunk):
                h.update(mv[off:off + chunk])
            return h.hexdigest()
        return go

    for name in ALGORITHMS:
        try:
            new_hasher(name)
        except ImportError as exc:  # said, never skipped silently: the message names the extra
            rows.append({"algorithm": name, "error": str(exc)})
            log(f"  hash {name}: skipped: {exc}")
            continue
        make_raw, one_shot = raw[name]
        # Interleaved: every rep times each way once, so drift (other work on this shared
        # machine) hits them alike and the ratios stay meaningful.
        fns: dict[str, Callable[[], Any]] = {"one": partial(one_shot, mv)}
        for chunk in chunk_sizes:
            fns[f"ck{chunk}"] = chunked(partial(new_hasher, name), chunk)
            fns[f"raw{chunk}"] = chunked(make_raw, chunk)
        t = interleaved(fns)
        row: dict[str, Any] = {"algorithm": name,
                               "cryptographic": ALGORITHMS[name].cryptographic,
                               "raw_one_shot_gbps": round(nbytes / t["one"] / 1e9, 3),
                               "chunks": []}
        for chunk in chunk_sizes:
            t_ck, t_raw = t[f"ck{chunk}"], t[f"raw{chunk}"]
            row["chunks"].append({"chunk": chunk,
                                  "ckptfs_gbps": round(nbytes / t_ck / 1e9, 3),
                                  "raw_chunked_gbps": round(nbytes / t_raw / 1e9, 3),
                                  "ckptfs_vs_one_shot": round(t["one"] / t_ck, 3),
                                  "ckptfs_vs_raw_chunked": round(t_raw / t_ck, 3)})
        rows.append(row)
        log(f"  hash {name}: one-shot {row['raw_one_shot_gbps']} GB/s; ckptfs "
            + ", ".join(f"{fmt_size(c['chunk'])} {c['ckptfs_gbps']}" for c in row["chunks"]))
    extras: list[dict[str, Any]] = []
    tools: list[dict[str, Any]] = []
    try:
        import blake3

        t_mt = measure(lambda: blake3.blake3(mv, max_threads=blake3.blake3.AUTO).digest())
        extras.append({"what": "blake3 one-shot, max_threads=AUTO (its own threads)",
                       "gbps": round(nbytes / t_mt / 1e9, 3)})
    except ImportError:
        pass
    with tempfile.TemporaryDirectory(prefix="ckptfs-hash-") as tmp:
        path = os.path.join(tmp, "data.bin")
        with open(path, "wb") as f:
            f.write(mv)
        for tool in ("sha256sum", "b3sum", "xxh128sum"):
            exe = shutil.which(tool)
            if exe is None:
                tools.append({"tool": tool, "installed": False})
                continue
            t_tool = measure(partial(subprocess.run, [exe, path], check=True,
                                     capture_output=True))
            tools.append({"tool": tool, "installed": True,
                          "gbps": round(nbytes / t_tool / 1e9, 3)})
    return {"question": "hash", "bytes": nbytes, "reps": reps, "rows": rows, "extras": extras,
            "tools": tools, "load_before": None}


def _raw_hashers() -> dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]]:
    """Each library used directly, as a user of it would."""
    import hashlib

    out: dict[str, tuple[Callable[[], Any], Callable[[Any], Any]]] = {
        "sha256": (hashlib.sha256, lambda b: hashlib.sha256(b).hexdigest())}
    try:
        import blake3

        out["blake3"] = (blake3.blake3, lambda b: blake3.blake3(b).hexdigest())
    except ImportError:
        pass
    try:
        import xxhash

        out["xxh3-128"] = (xxhash.xxh3_128, lambda b: xxhash.xxh3_128(b).hexdigest())
    except ImportError:
        pass
    try:
        import crc32c

        class _RawCrc:
            def __init__(self) -> None:
                self.v = 0

            def update(self, b: Any) -> None:
                self.v = crc32c.crc32c(b, self.v)

            def hexdigest(self) -> str:
                return f"{self.v:08x}"

        out["crc32c"] = (_RawCrc, lambda b: f"{crc32c.crc32c(b):08x}")
    except ImportError:
        pass
    return out

