"""How much of the save driver one process and a process group share (issue 33's probe).

Records which of ckptfs's own functions run during ``store.save`` (the second save of a run:
planning, writing, committing; the storage adapter, the front ends, the tooling and the group's
transport left out) in one process with the default layout (format v1), in one process with
``layout="ranks"`` (the collective driver, a world of one) and on rank 0 of a 2-rank gloo job,
and prints the Jaccard index of each single-process set with rank 0's.

Usage: ``python -m benchmarks.driver_overlap``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.multiprocessing as mp

EXCLUDE = ("ckptfs.storage", "ckptfs.cli", "ckptfs.bench", "ckptfs.testing", "ckptfs.lightning",
           "ckptfs.transformers", "ckptfs.dcp", "ckptfs.torch_checkpointing")


def record(fn: Callable[[], Any]) -> list[str]:
    """The ckptfs functions called while ``fn`` runs (every thread)."""
    seen: set[str] = set()

    def prof(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        mod = frame.f_globals.get("__name__", "")
        if not mod.startswith("ckptfs") or mod.startswith(EXCLUDE):
            return
        name = frame.f_code.co_qualname
        if mod == "ckptfs.protocol.group" and name.startswith(("RankGroup", "WorldOfOne")):
            return  # the group's transport
        seen.add(f"{mod}.{name}")

    threading.setprofile(prof)
    sys.setprofile(prof)
    try:
        fn()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return sorted(seen)


def state(mesh: Any = None) -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = {f"l{i}": torch.randn(64, 32, generator=g) for i in range(6)}
    if mesh is not None:
        from torch.distributed.tensor import Shard, distribute_tensor

        model = {k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in model.items()}
    return {"model": model, "trainer": {"step": 3}}


def single(url: str, layout: str) -> list[str]:
    import ckptfs

    store = ckptfs.open(url, layout=layout)
    st = state()
    store.save(1, st)
    return record(lambda: store.save(2, st))


def rank_job(rank: int, world: int, root: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ckptfs

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{root}/rdv", rank=rank,
                            world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        store = ckptfs.open(f"{root}/job")
        st = state(mesh)
        store.save(1, st)
        got = record(lambda: store.save(2, st))
        if rank == 0:
            with open(f"{root}/rank0.json", "w") as f:
                json.dump(got, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> int:
    root = tempfile.mkdtemp(prefix="ckptfs-overlap-")
    one = set(single(f"{root}/v1", "auto"))
    ranks = set(single(f"{root}/ranks", "ranks"))
    mp.spawn(rank_job, args=(2, root), nprocs=2, join=True)
    with open(f"{root}/rank0.json") as f:
        rank0 = set(json.load(f))

    def jaccard(a: set[str], b: set[str]) -> float:
        return len(a & b) / len(a | b)

    print(json.dumps({
        "functions": {"one process (v1)": len(one), "one process, layout='ranks'": len(ranks),
                      "rank 0 of 2": len(rank0)},
        "jaccard with rank 0 of 2": {"one process (v1)": round(jaccard(one, rank0), 3),
                                     "one process, layout='ranks'": round(jaccard(ranks, rank0),
                                                                          3)},
        "only rank 0 (layout='ranks' aside)": sorted(rank0 - ranks)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
