"""Launch a function on W gloo ranks (processes on this machine), with a hard timeout.

``run_ranks(fn, world, *args)`` starts ``world`` processes, each of which joins a gloo process
group (rendezvous through a file, so no port can collide; loopback only), runs
``fn(rank, world, *args)``, waits at a barrier (a rank leaving early made gloo abort its peer in
``destroy_process_group`` now and then) and returns ``fn``'s result.  The parent returns the
results in rank order, or raises :class:`RankFailure` with every failing rank's traceback.  A
job that has not finished after ``timeout`` seconds is killed, process by process (never by
name), and the test fails instead of hanging the suite.

Ranks are forked from a ``forkserver`` that imported torch and ckptfs once (:data:`PRELOAD`).
``fn`` must be a module-level function of an importable module (it is pickled by name); its
arguments and results must be picklable.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

#: Environment of every rank: loopback only, quiet, one thread per rank (2 shared cores).
RANK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
            "CKPTFS_TEST_JOB": "1"}


#: Imported once by the fork server, before any rank exists (no threads, no process group).
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp",
           "torch.distributed.tensor", "ckptfs", "ckptfs.protocol.sharded", "ckptfs.dcp"]


class RankFailure(AssertionError):
    def __init__(self, message: str, errors: dict[int, str]) -> None:
        super().__init__(message)
        self.errors = errors


def _child(fn: Callable[..., Any], rank: int, world: int, rdv: str, out: str,
           pg_timeout: float, env: dict[str, str], final_barrier: bool,
           args: tuple[Any, ...]) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result: Any = None
    error: str | None = None
    try:
        dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=pg_timeout))
        try:
            result = fn(rank, world, *args)
        finally:
            if final_barrier:
                dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # reported to the parent, which fails the test
        error = traceback.format_exc()
    with open(f"{out}/rank-{rank}.pkl", "wb") as f:
        pickle.dump((result, error), f)


def run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout: float = 120.0,
              pg_timeout: float = 60.0, env: dict[str, str] | None = None,
              exits: dict[int, int] | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; results in rank order.

    ``exits={rank: code}``: that rank is expected to die (``os._exit(code)``, a killed node) and
    its result is ``None``; it is an error if it returns or exits otherwise.  The job then skips
    the final barrier (a dead peer cannot join it)."""
    exits = exits or {}
    ctx = mp.get_context("forkserver")
    # One server process imports torch and ckptfs once; each rank is a fork of it (importing
    # torch in every rank costs seconds of the 2 shared cores).
    ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="ckptfs-dist-") as tmp:
        rdv = f"{tmp}/rendezvous"
        full_env = {**RANK_ENV, **(env or {})}
        procs = [ctx.Process(target=_child, args=(fn, r, world, rdv, tmp, pg_timeout, full_env,
                                                  not exits, args), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()  # this job's own processes, one by one
        for p in procs:
            p.join(10)
        results: list[Any] = []
        errors: dict[int, str] = {}
        for r in range(world):
            path = Path(tmp) / f"rank-{r}.pkl"
            if r in exits:
                if path.exists() or procs[r].exitcode != exits[r]:
                    errors[r] = (f"expected to die with exit code {exits[r]}; exit code "
                                 f"{procs[r].exitcode}, result file: {path.exists()}")
                results.append(None)
                continue
            if not path.exists():
                errors[r] = ("killed after the timeout" if r in hung
                             else f"exited with code {procs[r].exitcode} and no result")
                results.append(None)
                continue
            with open(path, "rb") as f:
                result, error = pickle.load(f)
            results.append(result)
            if error is not None:
                errors[r] = error
        if errors:
            detail = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise RankFailure(f"{len(errors)} of {world} ranks failed"
                              f"{f' (timeout {timeout:.0f} s)' if hung else ''}:\n{detail}",
                              errors)
        return results


def save_sharded(storage: Any, step: int, state: Any, *, memory: Any = None,
                 metadata: Any = None, process_group: Any = None, **options: Any) -> Any:
    """A collective save of ``state`` through the one entry users call: ``store.save`` of a
    store of ``layout="ranks"`` over ``storage`` (every rank of the group calls it; in one
    process, the world of one).  ``memory``: an incremental store's reuse memory, shared by
    the saves given it (format v4); ``options``: the store's (``algorithm``, ``lease_s``,
    ``metadata_layout``, ...; ``metadata_layout`` defaults to None, one ``dcp.msgpack``)."""
    from ckptfs.protocol.store import CheckpointStore

    options.setdefault("metadata_layout", None)
    store = CheckpointStore(storage, layout="ranks", **options)
    if memory is not None:
        store.options = store.options.but(reuse=memory)
    return store.save(step, state, metadata=metadata, process_group=process_group)
