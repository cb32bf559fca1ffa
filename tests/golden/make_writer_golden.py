"""The writer golden: for a fixed clock, attempt name, writer identity and state, every writer
of ckptfs produces the same bytes, file for file, manifest and marker included.

tests/golden/writers/<writer>.json holds, per writer, ``{path under the run root: sha256}`` of
everything the writer leaves on storage.  The states are the recipes of
tests/golden/make_golden.py (plain arithmetic: any torch on any platform builds the same
values).  tests/format/test_writer_golden.py runs every writer again and compares: a change of the
write side that changes a byte fails there, naming the writer and the first differing file.
A change that means to change the bytes (a fix of what a writer stores) regenerates the
digests, deliberately, and says so in its commit::

    python tests/golden/make_writer_golden.py --force      # rewrite tests/golden/writers/
    python tests/golden/make_writer_golden.py --print one  # the digests of one group (JSON)

What is fixed while a writer runs (`frozen`): ``datetime.now`` (the attempt names' time and
the manifests' and markers' ``created``) in every loaded ``ckptfs`` module and in the
``datetime`` module, ``secrets.token_hex`` (the attempt names' random part: the number of the
step being written, whatever else a writer draws), and the writer
identity a marker records (``socket.gethostname``, ``os.getpid``).  Only public entry points
and ``ckptfs cp``'s ``copy_step`` are driven, so the golden survives a refactor of the
writers' internals.

The writers run in groups, each group in a fresh process (``--print GROUP``):

* ``none``: no process group. ``v1`` (``store.save``), ``v3`` (an ``incremental=True``
  store: step 2 references step 1), ``async-v1`` and ``async-v3`` (``save_async`` of the
  same), ``dcp`` (``dcp.save(no_dist=True)`` through ``ckptfs.dcp.Writer``: format v2, one
  rank), and ``cp-*`` of each (``copy_step`` into a fresh root), ``replica-v1`` and
  ``replica-v3`` (the remote tier of ``ckptfs.tiered(local, remote)`` after
  ``wait_replicated``).
* ``one``: a one-rank gloo process group. ``v2`` (``store.save(process_group=WORLD)`` of
  DTensors on a one-rank mesh), ``v4`` (the same on an ``incremental=True`` store: step 2
  references step 1), ``async-v2`` and ``async-v4`` (``save_async`` of the same DTensor
  states), ``v5`` and ``async-v5`` (v2's recipe on a store opened with
  ``metadata_layout="per-rank"``: format v5, one rank), and ``cp-v2``, ``cp-v4``, ``cp-v5``.
* ``two``: two gloo ranks (processes). ``v2x2`` (step 1 of the v2 golden recipe) and ``v4x2``
  (both steps of the v4 golden recipe, as tests/golden/v4 was written), and ``cp-v4x2``.

Every in-process writer writes to a ``memory://`` root of a fixed name (a copy's marker records
its source's URL, DCP's metadata the checkpoint's); the two-rank writers write to local disk at
a fixed path (`TWO_RANK_ROOT`), and their copy reads a ``memory://`` replica of those files.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import hashlib
import importlib
import importlib.util
import inspect
import json
import os
import pkgutil
import secrets
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
OUT = HERE / "writers"
GROUPS = ("none", "one", "two")

#: The fixed clock, attempt token and writer identity.
CLOCK = _dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=_dt.timezone.utc)
TOKEN = "5eed"
HOST = "golden-host"
PID = 4242
#: Where the two-rank writers write (local disk, a fixed path).
TWO_RANK_ROOT = "/tmp/ckptfs-writer-golden"

Digests = dict[str, str]

#: What a reader of a digest file should know about the bytes it records.
NOTES = {
    "async-v4": "save_async of a DTensor state on an incremental store: format v4, as the "
                "synchronous sharded save (regenerated when that was fixed: it wrote v2); its "
                "rank files are v4's bytes, its dcp.msgpack and manifest differ from v4's as "
                "async-v2's differ from v2's",
    "replica-v1": "a two-tier store has one hash algorithm: both steps blake3",
    "async-v2": "step 1 only (step 2 of the recipe holds no DTensor: save_async writes v1)",
    "async-v5": "step 1 only, as async-v2 (step 2 of the recipe holds no DTensor)",
}


def _recipes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("make_golden", HERE / "make_golden.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


R = _recipes()


# -- the fixed clock and names ------------------------------------------------------------------


_REAL = _dt.datetime


class _AnyDatetime(type):
    """``isinstance(x, FrozenDatetime)`` is ``isinstance(x, datetime)``: code that checks a
    value against the patched name keeps accepting real datetimes."""

    def __instancecheck__(cls, obj: object) -> bool:
        return isinstance(obj, _REAL)

    def __subclasscheck__(cls, sub: type) -> bool:
        return issubclass(sub, _REAL)


class FrozenDatetime(_REAL, metaclass=_AnyDatetime):
    @classmethod
    def now(cls, tz: Any = None) -> Any:
        return CLOCK if tz is not None else CLOCK.replace(tzinfo=None)

    @classmethod
    def utcnow(cls) -> Any:
        return CLOCK.replace(tzinfo=None)


def _import_all() -> None:
    """Every module of the ckptfs packages a writer may use (several import lazily): so the
    clock is patched in each before it runs."""
    import ckptfs

    for sub in ("format", "protocol", "storage", "lifecycle"):
        pkg = importlib.import_module(f"ckptfs.{sub}")
        for mod in pkgutil.iter_modules(pkg.__path__, f"ckptfs.{sub}."):
            with contextlib.suppress(Exception):
                importlib.import_module(mod.name)
    with contextlib.suppress(Exception):
        importlib.import_module("ckptfs.dcp")
    assert ckptfs


def _token(nbytes: int | None = None) -> str:
    """The attempt names' "random" part: the step being written, read from the nearest caller
    with an integer local ``step`` (every writer names an attempt for a step), so a name does
    not depend on how many names a writer drew before."""
    frame = inspect.currentframe()
    step = None
    while frame is not None and step is None:
        value = frame.f_locals.get("step")
        if isinstance(value, int) and not isinstance(value, bool):
            step = value
        frame = frame.f_back
    del frame
    if step is None:
        raise AssertionError("the writer golden: an attempt name drawn outside any step")
    return f"{TOKEN}{step:016x}"[-2 * (8 if nbytes is None else nbytes):]


@contextlib.contextmanager
def frozen() -> Iterator[None]:
    """The fixed clock, attempt token and writer identity (module docstring)."""
    _import_all()
    undo: list[tuple[Any, str, Any]] = []

    def patch(obj: Any, name: str, value: Any) -> None:
        undo.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    for name, mod in list(sys.modules.items()):
        if ((name == "ckptfs" or name.startswith("ckptfs.")) and mod is not None
                and getattr(mod, "datetime", None) is _REAL):
            patch(mod, "datetime", FrozenDatetime)
    patch(_dt, "datetime", FrozenDatetime)
    patch(secrets, "token_hex", _token)
    patch(socket, "gethostname", lambda: HOST)
    patch(os, "getpid", lambda: PID)
    try:
        yield
    finally:
        for obj, name, value in reversed(undo):
            setattr(obj, name, value)


# -- reading what a writer left -----------------------------------------------------------------


def digests_of(url: str) -> Digests:
    """``{path under the root: sha256}`` of every file under ``url`` (``memory://`` or a local
    directory)."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    out: Digests = {}
    for path in sorted(fs.find(root)):
        rel = path[len(root):].lstrip("/")
        out[rel] = hashlib.sha256(fs.cat_file(path)).hexdigest()
    return dict(sorted(out.items()))


def fresh(name: str) -> str:
    """A ``memory://`` root of a fixed name, empty."""
    import fsspec

    url = f"memory://writer-golden/{name}"
    fs = fsspec.filesystem("memory")
    if fs.exists(f"/writer-golden/{name}"):
        fs.rm(f"/writer-golden/{name}", recursive=True)
    return url


def copy_all(src_url: str, name: str) -> str:
    """``ckptfs cp`` of every committed step of ``src_url``, ascending, into a fresh root."""
    import ckptfs
    from ckptfs.protocol.copy import copy_step

    dst_url = fresh(name)
    src = ckptfs.open(src_url)
    dst = ckptfs.open(dst_url)
    for step in src.steps():
        copy_step(src.storage, dst.storage, step, threads=1)
    return dst_url


def replicate_all(save: Callable[[Any], object], name: str, **options: Any) -> str:
    """``save(store)`` on a two-tier store (``options``: `ckptfs.tiered`'s) whose local and
    remote tiers are fresh roots, then ``wait_replicated``: the remote tier's root."""
    import ckptfs

    local, remote = fresh(f"{name}-local"), fresh(name)
    store = ckptfs.tiered(local, remote, replicate_threads=1, **options)
    try:
        save(store)
        store.wait_replicated(timeout=120)
    finally:
        store.close()
    return remote


# -- the writers, by group ----------------------------------------------------------------------


def save_v1(store_of: Callable[[str], Any], asynchronous: bool = False) -> None:
    for step, (state, meta, algorithm) in sorted(R.golden_v1().items()):
        store = store_of(algorithm)
        if asynchronous:
            store.save_async(step, state, metadata=meta).result()
            store.close()
        else:
            store.save(step, state, metadata=meta)


def save_v3(store: Any, asynchronous: bool = False) -> None:
    for step, (state, meta, _) in sorted(R.golden_v3().items()):
        if asynchronous:
            store.save_async(step, state, metadata=meta).result()
        else:
            store.save(step, state, metadata=meta)
    store.close()


def group_none() -> dict[str, Digests]:
    import ckptfs
    from ckptfs.torch_versions import sharded_supported

    if sharded_supported():
        import torch.distributed.checkpoint as dcp

        import ckptfs.dcp

    out: dict[str, str] = {}
    v3_algorithm = R.golden_v3()[1][2]

    url = out["v1"] = fresh("v1")
    save_v1(lambda a: ckptfs.open(url, algorithm=a))
    url_a = out["async-v1"] = fresh("async-v1")
    save_v1(lambda a: ckptfs.open(url_a, algorithm=a), asynchronous=True)
    out["v3"] = fresh("v3")
    save_v3(ckptfs.open(out["v3"], algorithm=v3_algorithm, incremental=True))
    out["async-v3"] = fresh("async-v3")
    save_v3(ckptfs.open(out["async-v3"], algorithm=v3_algorithm, incremental=True), True)
    if sharded_supported():  # ckptfs.dcp needs torch >= 2.9 (ckptfs/torch_versions.py)
        url_d = out["dcp"] = fresh("dcp")
        for step, (state, meta, algorithm, _) in sorted(R.golden_v2().items()):
            dcp.save(state, storage_writer=ckptfs.dcp.Writer(url_d, step, algorithm=algorithm,
                                                             metadata=meta),
                     planner=ckptfs.dcp.SavePlanner(), no_dist=True)
    for name in ("v1", "v3", "dcp"):
        if name in out:
            out[f"cp-{name}"] = copy_all(out[name], f"cp-{name}")
    # Two tiers: one algorithm per store, so v1's two steps are both blake3 here.
    out["replica-v1"] = replicate_all(
        lambda s: [s.save(step, state, metadata=meta)
                   for step, (state, meta, _) in sorted(R.golden_v1().items())], "replica-v1")
    out["replica-v3"] = replicate_all(
        lambda s: [s.save(step, state, metadata=meta)
                   for step, (state, meta, _) in sorted(R.golden_v3().items())], "replica-v3",
        algorithm=v3_algorithm, incremental=True)
    return {name: digests_of(u) for name, u in out.items()}


@contextlib.contextmanager
def one_rank_group() -> Iterator[Any]:
    """A one-rank gloo process group and a one-rank CPU mesh."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/rdv", rank=0,
                                world_size=1, timeout=timedelta(seconds=120))
        try:
            yield init_device_mesh("cpu", (1,))
        finally:
            dist.destroy_process_group()


def one_rank(full: dict[str, Any], mesh: Any, memo: dict[int, Any] | None = None
             ) -> dict[str, Any]:
    """The golden state's ``rows``/``cols`` as DTensors on the one-rank mesh (the rest
    plain)."""
    state = R.rank_state(full, 0, mesh, memo)
    state["rng"] = full["rng"]
    return state


def group_one() -> dict[str, Digests]:
    import torch.distributed as dist

    import ckptfs

    out: dict[str, str] = {}
    with one_rank_group() as mesh:
        world = dist.group.WORLD
        v2 = R.golden_v2()
        v4 = R.golden_v4()
        v4_algorithm = v4[1][2]

        def v2_state(step: int) -> dict[str, Any]:
            state = v2[step][0]
            return one_rank(state, mesh) if "rows" in state else state

        v5 = R.golden_v5()
        for name, asynchronous in (("v2", False), ("async-v2", True), ("v5", False),
                                   ("async-v5", True)):
            url = out[name] = fresh(name)
            recipe, layout = (v5, "per-rank") if name.endswith("v5") else (v2, None)
            for step, (_, meta, algorithm, _) in sorted(recipe.items()):
                store = ckptfs.open(url, algorithm=algorithm, metadata_layout=layout)
                if asynchronous:
                    if "rows" not in v2[step][0]:
                        continue  # no DTensor: save_async of a plain state is v1
                    store.save_async(step, v2_state(step), metadata=meta).result()
                    store.close()
                else:
                    store.save(step, v2_state(step), metadata=meta, process_group=world)
        for name, asynchronous in (("v4", False), ("async-v4", True)):
            url = out[name] = fresh(name)
            store = ckptfs.open(url, algorithm=v4_algorithm, incremental=True)
            memo: dict[int, Any] = {}
            for step, (full, meta, _, _) in sorted(v4.items()):
                state = one_rank(full, mesh, memo)
                if asynchronous:
                    store.save_async(step, state, metadata=meta).result()
                else:
                    store.save(step, state, metadata=meta, process_group=world)
            store.close()
    for name in ("v2", "v4", "v5"):
        out[f"cp-{name}"] = copy_all(out[name], f"cp-{name}")
    return {name: digests_of(u) for name, u in out.items()}


def _rank(what: str, rank: int, world: int, out: str, rdv: str) -> None:
    """One gloo rank of a ``two`` writer (tests/golden/make_golden.py's ``_rank``, frozen)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import ckptfs

    dist.init_process_group("gloo", init_method=f"file://{rdv}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        mesh = init_device_mesh("cpu", (world,))
        with frozen():
            if what == "v2x2":
                full, meta, algorithm, _ = R.golden_v2()[1]
                ckptfs.open(out, algorithm=algorithm).save(1, R.rank_state(full, rank, mesh),
                                                            metadata=meta)
            else:
                recipe = R.golden_v4()
                store = ckptfs.open(out, algorithm=recipe[1][2], incremental=True)
                memo: dict[int, Any] = {}
                for step, (full, meta, _, _) in sorted(recipe.items()):
                    store.save(step, R.rank_state(full, rank, mesh, memo), metadata=meta)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def group_two() -> dict[str, Digests]:
    import multiprocessing as mp
    import shutil

    import fsspec

    result: dict[str, Digests] = {}
    tmp = TWO_RANK_ROOT  # a fixed path: DCP's metadata records the checkpoint's URL
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        for what in ("v2x2", "v4x2"):
            out = f"{tmp}/{what}"
            ctx = mp.get_context("spawn")
            procs = [ctx.Process(target=_rank, args=(what, r, 2, out, f"{tmp}/rdv-{what}"))
                     for r in range(2)]
            for p in procs:
                p.start()
            for p in procs:
                p.join(300)
            codes = [p.exitcode for p in procs]
            if codes != [0, 0]:
                raise RuntimeError(f"{what}: a rank failed: exit codes {codes}")
            result[what] = digests_of(out)
        # The copy reads a memory:// replica of v4x2's files (a fixed source URL).
        src = fresh("v4x2")
        mem = fsspec.filesystem("memory")
        local = fsspec.filesystem("file")
        for rel in result["v4x2"]:
            mem.pipe_file(f"/writer-golden/v4x2/{rel}", local.cat_file(f"{tmp}/v4x2/{rel}"))
        with frozen():
            result["cp-v4x2"] = digests_of(copy_all(src, "cp-v4x2"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result


def run_group(group: str) -> dict[str, Digests]:
    """The digests of the writers of ``group``, in this process."""
    if group == "two":
        return group_two()
    with frozen():
        return group_none() if group == "none" else group_one()


def group_in_subprocess(group: str, timeout: float = 600) -> dict[str, Digests]:
    """`run_group` in a fresh process (the clock, the process group and ``memory://`` are
    per process)."""
    done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--print", group],
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the {group!r} writers failed (rc {done.returncode}):\n"
                           f"{done.stderr[-6000:]}")
    result: dict[str, Digests] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def expected(writer: str) -> Digests:
    """The checked-in digests of ``writer``."""
    doc = json.loads((OUT / f"{writer}.json").read_text())
    files: Digests = doc["files"]
    return files


def group_of(writer: str) -> str:
    """The group a checked-in ``writer`` runs in."""
    return str(json.loads((OUT / f"{writer}.json").read_text())["group"])


def note_of(writer: str) -> str:
    return str(json.loads((OUT / f"{writer}.json").read_text()).get("note", ""))


def writers() -> list[str]:
    return sorted(p.stem for p in OUT.glob("*.json"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--print", choices=GROUPS, dest="group",
                        help="print the digests of one group's writers (JSON), write nothing")
    parser.add_argument("--force", action="store_true",
                        help="rewrite tests/golden/writers/ (a deliberate change of bytes)")
    args = parser.parse_args()
    if args.group:
        print(json.dumps(run_group(args.group), sort_keys=True))
        return
    if OUT.exists() and any(OUT.iterdir()) and not args.force:
        sys.exit(f"{OUT} exists: the writer golden is regenerated only with --force, for a "
                 "deliberate change of the stored bytes (module docstring)")
    OUT.mkdir(exist_ok=True)
    for group in GROUPS:
        for writer, files in sorted(group_in_subprocess(group).items()):
            doc: dict[str, Any] = {"group": group, "files": files}
            if writer in NOTES:
                doc["note"] = NOTES[writer]
            (OUT / f"{writer}.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
            print(f"{writer}: {len(files)} files")


if __name__ == "__main__":
    main()
