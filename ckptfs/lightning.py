"""ckptfs as the checkpoint storage of PyTorch Lightning (``import lightning``, 2.4 or newer).

::

    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    import ckptfs.lightning

    trainer = L.Trainer(
        plugins=[ckptfs.lightning.CkptfsCheckpointIO()],          # storage options go here
        callbacks=[ModelCheckpoint(dirpath="s3://bucket/run1", monitor="val_loss",
                                   save_top_k=2, save_last=True)])
    trainer.fit(model)
    trainer.fit(model, ckpt_path="last")                          # resume
    model = ckptfs.lightning.load_from_checkpoint(MyModule, "s3://bucket/run1/last.ckpt")

Design decision: **a Lightning checkpoint path is a small link file next to a ckptfs run root.**
Lightning names checkpoints by path (``<dirpath>/epoch=0-step=10.ckpt``, ``last.ckpt``),
overwrites a path when it saves it again (``last.ckpt`` every epoch), removes paths (top-k) and
asks fsspec whether a path exists (to choose ``-v1`` names) and when it was modified (to find
``ckpt_path="last"``).  ckptfs never overwrites a committed step.  So for a path ``P``::

    P                 a JSON link file (which run root, which step), written after each commit
    P.ckptfs/         a ckptfs run root: checkpoints/step-N/... (one committed step, normally)

Saving ``P`` commits step N+1 of ``P.ckptfs`` (step 0 the first time), exclusively, marker last;
only after that commit it rewrites the link and deletes the older steps, so a crash at any point
leaves a committed checkpoint and the root holds one committed step (plus, after a crash, an
incomplete attempt, which a later save of ``P`` deletes with its step).  The root is a plain ckptfs
run: ``ckptfs ls``, ``verify`` and ``inspect`` work on ``P.ckptfs``.  Loading ``P`` reads the
newest committed step of the root the link names (a link Lightning copied or symlinked for
``save_last="link"`` names the root it was written for); without a readable link it uses
``P.ckptfs``.  The link is what Lightning's ``fs.exists(P)`` and ``fs.modified(P)`` see, on every
backend: an object store has no modification time for a directory.  Removing ``P`` deletes the link
first (Lightning then sees the name as free), then every step of ``P.ckptfs`` (marker first), then
everything under it.

**Saving or removing ``P`` never changes what another path resolves to.**  ``save_last="link"``
makes ``last.ckpt`` a symbolic link to a top-k link file: saving ``last.ckpt`` replaces the
symbolic link itself with a link file of its own (writing through it would rewrite the top-k
path's link to name ``last.ckpt.ckptfs``), and removing it removes only the symbolic link.  A run
root ``P.ckptfs`` that is itself a symbolic link (ckptfs never makes one) is likewise replaced by a
real root on save and unlinked on remove, never committed into or pruned.  Links are found in the
listing of the directory (``Entry.is_link``), where directories are real (local disk; object
stores have none).  Reading ``P`` reads at most 64 KiB + 1 byte of it (a ranged read) and accepts
only a flat JSON link, so a large file or deeply nested JSON at ``P`` costs nothing and falls back
to ``P.ckptfs``.

Everything in the checkpoint is stored without pickle; hyper-parameters of the types ckptfs
registers (``pathlib`` paths, ``argparse.Namespace``, dataclasses and ``Enum`` members you
register, ``set``, NumPy arrays and scalars, ``torch.device``; see docs/protocol.md) come back
as themselves; anything else is refused before anything is written, naming its key path.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Callable
from typing import Any, TypeVar

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint as _ModelCheckpoint

import ckptfs
from ckptfs.errors import CheckpointNotFoundError, UnsupportedValueError
from ckptfs.lifecycle.artifacts import SubStorage
from ckptfs.storage.base import Storage, read_range

__all__ = ["LINK_FORMAT", "ROOT_SUFFIX", "CkptfsCheckpointIO", "ModelCheckpoint",
           "load_from_checkpoint", "root_of"]

#: The run root of a Lightning checkpoint path ``P`` is ``P + ROOT_SUFFIX``.
ROOT_SUFFIX = ".ckptfs"
#: The ``format`` field of a link file.
LINK_FORMAT = "ckptfs-lightning-link/1"
#: A link file larger than this is not a link (a ``torch.save`` file, say).
_MAX_LINK_BYTES = 64 * 1024
#: Nesting of a link file's JSON: a link is one flat object (depth 1); a little room for later
#: fields.  Deeper JSON is not a link (and never reaches the recursive JSON parser).
_MAX_LINK_DEPTH = 4
_JSON_SPECIAL = re.compile(rb'[\\"\[\]{}]')

M = TypeVar("M")


def _url(path: Any) -> str:
    """Lightning hands ``str`` or ``os.PathLike``; a path without a protocol is local."""
    text = os.fspath(path) if not isinstance(path, str) else path
    if "://" not in text:
        text = os.path.abspath(text)
    return text.rstrip("/")


def _split(url: str) -> tuple[str, str]:
    parent, _, name = url.rpartition("/")
    if not name or not parent or parent.endswith(":/"):
        raise CheckpointNotFoundError(f"{url!r} is not a checkpoint path inside a directory")
    return parent, name


def root_of(path: Any) -> str:
    """The ckptfs run root that holds the Lightning checkpoint ``path``: ``path + ".ckptfs"``."""
    return _url(path) + ROOT_SUFFIX


class CkptfsCheckpointIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that stores every checkpoint as a committed ckptfs
    checkpoint (module docstring: the layout).  Pass it as ``Trainer(plugins=[...])``.

    ``algorithm``, ``durable``, ``threads``, ``retries`` and ``storage_options`` (for example
    ``endpoint_url``, ``key``, ``secret`` on S3) are those of `ckptfs.open`, used for every
    path.  ``verify``: hash every byte while loading (default).  Lightning's own ``ModelCheckpoint``
    also asks fsspec whether a path exists, with no options: give it the credentials and endpoint
    through the environment or the fsspec configuration too (docs/integrations.md)."""

    def __init__(self, *, algorithm: str = ckptfs.DEFAULT_ALGORITHM, durable: bool = True,
                 threads: int | None = None, retries: int = 3, verify: bool = True,
                 **storage_options: Any) -> None:
        self.verify = verify
        self._open_kwargs: dict[str, Any] = dict(
            algorithm=algorithm, durable=durable, threads=threads, retries=retries,
            **storage_options)
        self._dirs: dict[str, ckptfs.CheckpointStore] = {}

    def _dir(self, url: str) -> ckptfs.CheckpointStore:
        """The checkpoint directory ``url``, opened once (one client, one probe)."""
        store = self._dirs.get(url)
        if store is None:
            if len(self._dirs) > 64:
                self._dirs.clear()
            store = self._dirs[url] = ckptfs.open(url, **self._open_kwargs)
        return store

    def _root(self, parent: str, root: str) -> ckptfs.CheckpointStore:
        """The run root ``root`` (a name) inside the directory ``parent``."""
        base = self._dir(parent)
        return ckptfs.CheckpointStore(SubStorage(base.storage, root), algorithm=base.algorithm,
                                      durable=base.durable, threads=base.threads,
                                      shard_bytes=base.shard_bytes)

    # -- the three calls of Lightning ------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Commit ``checkpoint`` as the new content of ``path`` (replacing the previous one only
        once the new one has committed).  Values the format cannot hold raise
        `UnsupportedValueError` naming their key path, before anything is
        written."""
        if storage_options is not None:
            raise UnsupportedValueError(
                f"save_checkpoint({path!r}, storage_options=...): CkptfsCheckpointIO takes its "
                "storage options once, as CkptfsCheckpointIO(**storage_options)")
        url = _url(path)
        parent, name = _split(url)
        root = name + ROOT_SUFFIX
        storage = self._dir(parent).storage
        links = _symlinks(storage, (name, root))
        if root in links:
            # Committing through a linked root would commit into (and prune) another path's.
            storage.delete(root)        # the link only, never what it points to
        store = self._root(parent, root)
        committed = store.steps()
        step = committed[-1] + 1 if committed else 0
        info = store.save(step, checkpoint, metadata={"lightning": {
            "path": name, "epoch": checkpoint.get("epoch"),
            "global_step": checkpoint.get("global_step")}})
        link = {"format": LINK_FORMAT, "root": root, "step": info.step,
                "load_with": "ckptfs.lightning.load_from_checkpoint(ModelClass, path)"}
        if name in links:
            # save_last="link": writing through the symbolic link would rewrite the link file
            # of the path it points to.  Replace the symbolic link itself (a crash in between
            # leaves no link: loading P then falls back to P.ckptfs, just committed).
            storage.delete(name)
        storage.write_bytes(name, json.dumps(link, indent=1).encode() + b"\n")
        for old in store.all_steps():
            if old < info.step:
                store.delete(old)
        _forget_listing(url)

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The newest committed checkpoint of ``path``, every byte verified as it is read.
        ``map_location`` as for `ckptfs.CheckpointStore.load`; ``weights_only`` is
        accepted and ignored (nothing is ever unpickled)."""
        del weights_only
        store = self._root(*self._resolve_root(_url(path)))
        try:
            return store.load(map_location=map_location, verify=self.verify)
        except CheckpointNotFoundError as exc:
            raise CheckpointNotFoundError(
                f"no Lightning checkpoint at {_url(path)}: {exc}") from None

    def remove_checkpoint(self, path: Any) -> None:
        """Delete ``path`` completely: its link, then every step of its run root (marker
        first), then whatever else is under the root (incomplete attempts).  Absent is not an
        error, as for ``fs.rm``."""
        url = _url(path)
        parent, name = _split(url)
        root = name + ROOT_SUFFIX
        storage = self._dir(parent).storage
        links = _symlinks(storage, (root,))
        storage.delete(name)            # a symbolic link (save_last="link"): the link only
        _forget_listing(url)
        if root in links:
            storage.delete(root)        # a linked root: the link only, never its target
        else:
            store = self._root(parent, root)
            for step in store.all_steps():
                store.delete(step)
            storage.delete_tree(root)
        _forget_listing(url)

    def teardown(self) -> None:
        self._dirs.clear()

    # -- helpers ----------------------------------------------------------------------------------

    def _resolve_root(self, url: str) -> tuple[str, str]:
        """(directory, root name): the run root the link at ``url`` names (a sibling of the
        link), or ``<name>.ckptfs`` when there is no readable link."""
        parent, name = _split(url)
        default = name + ROOT_SUFFIX
        try:
            # At most one byte more than a link may have: a large file here is not read whole.
            raw = read_range(self._dir(parent).storage, name, 0, _MAX_LINK_BYTES + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return parent, default
        root = _link_root(raw)
        if root is not None:
            return parent, root
        if self._root(parent, default).steps():
            return parent, default      # a torn link write: the root itself is the truth
        raise CheckpointNotFoundError(
            f"{url} is not a ckptfs Lightning checkpoint (not a link file written by "
            f"ckptfs.lightning, and {url}{ROOT_SUFFIX} holds no committed checkpoint); a file "
            "written by torch.save loads with torch.load, not through CkptfsCheckpointIO")


class ModelCheckpoint(_ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` (same arguments), with two fixes for URLs:

    - ``trainer.fit(ckpt_path="last")`` finds ``last.ckpt`` on object stores: Lightning lists the
      directory with fsspec, whose object-store listings drop the ``s3://`` (``gs://``,
      ``az://``) prefix, and then looks the names up on local disk, so it never finds them;
    - ``dirpath="file:///abs/dir"`` means ``/abs/dir`` (Lightning's ``realpath`` makes it the
      relative directory ``./file:/abs/dir``).

    On local disk with a plain path, Lightning's own class works the same."""

    def __init__(self, dirpath: Any = None, *args: Any, **kwargs: Any) -> None:
        if isinstance(dirpath, str) and dirpath.startswith("file://"):
            dirpath = dirpath[len("file://"):]
        super().__init__(dirpath, *args, **kwargs)

    def _find_last_checkpoints(self, trainer: Any) -> set[str]:
        found = super()._find_last_checkpoints(trainer)
        fs = self._fs
        if "file" in _protocols(fs):
            return found
        return {p if "://" in p else str(fs.unstrip_protocol(p)) for p in found}


def _protocols(fs: Any) -> tuple[str, ...]:
    proto = fs.protocol
    return (proto,) if isinstance(proto, str) else tuple(proto)


def _link_root(raw: bytes) -> str | None:
    """The root named by a link file, or ``None`` if ``raw`` is not a well-formed link.  The
    name must be a plain sibling ending in ``.ckptfs``: a link never points elsewhere."""
    if len(raw) > _MAX_LINK_BYTES or _json_depth(raw, _MAX_LINK_DEPTH) > _MAX_LINK_DEPTH:
        return None
    try:
        link = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(link, dict) or link.get("format") != LINK_FORMAT:
        return None
    root = link.get("root")
    if (not isinstance(root, str) or not root.endswith(ROOT_SUFFIX) or root == ROOT_SUFFIX
            or "/" in root or "\\" in root or root in (".", "..")
            or posixpath.normpath(root) != root):
        return None
    return root


def _json_depth(raw: bytes, limit: int) -> int:
    """How deeply the JSON text ``raw`` nests objects and arrays (brackets inside strings do not
    count), up to ``limit + 1``: one linear scan of its special characters, no recursion."""
    depth = deepest = 0
    in_string, escaped = False, -1
    for m in _JSON_SPECIAL.finditer(raw):
        pos, c = m.start(), m.group()
        if pos == escaped:
            continue
        if in_string:
            if c == b"\\":
                escaped = pos + 1
            elif c == b'"':
                in_string = False
        elif c == b'"':
            in_string = True
        elif c in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
            if deepest > limit:
                break
        elif c in (b"]", b"}"):
            depth -= 1
    return deepest


def _symlinks(storage: Storage, names: tuple[str, ...]) -> set[str]:
    """Which of ``names`` (entries of the directory ``storage`` is rooted at) are symbolic
    links, from one listing (``Entry.is_link``).  Only where directories are real: object stores
    have no links, and the listing would be one more request per save."""
    if not storage.capabilities.real_directories:
        return set()
    return {e.basename for e in storage.list_dir("") if e.is_link and e.basename in names}


def _forget_listing(url: str) -> None:
    """Drop what the fsspec instance Lightning uses for ``url`` (``get_filesystem``, no
    options) has cached about its directory: ``ModelCheckpoint`` asks it whether a name exists
    when it picks ``-v1`` names, and a stale listing would answer for a deleted checkpoint."""
    from lightning.fabric.utilities.cloud_io import get_filesystem
    try:
        fs = get_filesystem(url)
        fs.invalidate_cache(url.rpartition("/")[0])
        fs.invalidate_cache(url)
    except Exception:                   # only a cache hint: the store itself is the truth
        return


def load_from_checkpoint(cls: type[M], path: Any, map_location: Any | None = None, *,
                         strict: bool | None = None, storage_options: dict[str, Any] | None = None,
                         verify: bool = True, **kwargs: Any) -> M:
    """``cls.load_from_checkpoint(path, ...)`` for a checkpoint written by
    `CkptfsCheckpointIO`: the class is built from the stored hyper-parameters (``kwargs``
    override them, as in Lightning) and its weights loaded; works for a ``LightningModule`` or a
    ``LightningDataModule``.  ``storage_options`` as for `ckptfs.open`.

    Lightning's own ``load_from_checkpoint`` reads ``path`` with ``torch.load`` and cannot read
    a ckptfs checkpoint; this helper runs the same steps (``_load_state``, the checkpoint
    migration) on the checkpoint ckptfs loaded."""
    import lightning.pytorch as pl
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint

    io = CkptfsCheckpointIO(verify=verify, **(storage_options or {}))
    checkpoint = _pl_migrate_checkpoint(io.load_checkpoint(path, map_location),
                                        checkpoint_path=None)
    if not (isinstance(cls, type)
            and issubclass(cls, (pl.LightningModule, pl.LightningDataModule))):
        raise UnsupportedValueError(
            f"load_from_checkpoint() takes a LightningModule or LightningDataModule class, got "
            f"{cls!r:.80}")
    key = cls.CHECKPOINT_HYPER_PARAMS_KEY       # "datamodule_hyper_parameters" for a datamodule
    checkpoint.setdefault(key, {})
    checkpoint[key].update(kwargs)
    load: Callable[..., Any] = _load_state
    if issubclass(cls, pl.LightningDataModule):
        return load(cls, checkpoint, **kwargs)  # type: ignore[no-any-return]
    model = load(cls, checkpoint, strict=strict, **kwargs)
    tensors = [t for t in checkpoint.get("state_dict", {}).values() if hasattr(t, "device")]
    if tensors:
        model = model.to(tensors[0].device)
    return model  # type: ignore[no-any-return]
