"""Hugging Face ``transformers.Trainer`` checkpoints in a ckptfs store (docs/integrations.md).

`CkptfsTrainer` is a ``Trainer`` whose checkpoints are ckptfs checkpoints: one committed
step per ``save_steps`` (marker last, content hashes, no pickle) on any URL ckptfs opens, instead
of ``checkpoint-N`` folders of ``torch.save`` pickles under ``output_dir``.  A checkpoint holds::

    {"model": model.state_dict(), "optimizer": ..., "scheduler": ..., "scaler": ... (if any),
     "rng": {"world_size": W, "ranks": {rank: RNG state}},   # ckptfs.lifecycle.rng, per rank
     "trainer_state": <trainer_state.json content, as a msgpack map>}

The Trainer features that act on checkpoints keep working: ``save_total_limit`` (rotation
deletes from the store, newest and best kept, as the Trainer does), ``load_best_model_at_end``
(``state.best_model_checkpoint`` is the URL of the best step; the weights are read from the
store), ``resume_from_checkpoint`` (``True``: the newest committed step; an int step,
``"checkpoint-N"`` or a step URL ``<root>/checkpoints/step-000000000N``).

Design: the Trainer reads a checkpoint through path-taking methods (``_load_from_checkpoint``,
``_load_optimizer_and_scheduler``, ``_load_scaler``, ``_load_rng_state``), and
``train()``/``_init_training_state`` read ``trainer_state.json`` by path.  ``train`` here
resolves and loads (verified) the whole checkpoint once, calls the base ``train`` without a
checkpoint (so nothing reads a local path), and the overridden ``_inner_training_loop`` hands
the loop a reference string, so that the base loop still skips the trained batches and calls
the loaders below, which read the loaded state instead of files.  These are private methods of
transformers 5 (checked at construction: `BackendUnavailableError` otherwise).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import Trainer, TrainerState
from transformers.trainer_callback import ExportableState
from transformers.trainer_utils import SaveStrategy, compare_trainer_and_checkpoint_args

import ckptfs
from ckptfs.errors import (
    BackendUnavailableError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InvalidStepError,
    ProvenanceMismatchError,
    ShardedCheckpointError,
)
from ckptfs.format.layout import CHECKPOINTS_DIR, step_dir_name
from ckptfs.lifecycle import rng
from ckptfs.lifecycle.artifacts import SubStorage

log = logging.getLogger("ckptfs")

#: The Trainer methods this integration overrides or relies on (transformers 5).
REQUIRED_TRAINER_METHODS = (
    "_save_checkpoint", "_inner_training_loop", "_init_training_state", "_load_from_checkpoint",
    "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state", "_load_best_model",
    "_finalize_training", "_load_callback_state", "_issue_warnings_after_load",
)
_STEP_URL_RE = re.compile(r"^(?P<root>.*?)/?" + CHECKPOINTS_DIR + r"/step-(?P<step>[0-9]+)/?$")
_HF_NAME_RE = re.compile(r"^checkpoint-(?P<step>[0-9]+)$")


def rotation(steps: list[int], save_total_limit: int | None, best: int | None) -> list[int]:
    """The steps ``save_total_limit`` deletes, oldest first: the Trainer's rule
    (``transformers.trainer_utils.rotate_checkpoints``) on committed steps ordered by step.
    The newest and the best step are never deleted; at most ``max(limit, protected)`` stay."""
    if save_total_limit is None or save_total_limit <= 0 or len(steps) <= save_total_limit:
        return []
    ordered = sorted(steps)
    protected = {ordered[-1]} | ({best} if best in ordered else set())
    keep = max(save_total_limit, len(protected))
    remaining, doomed = len(ordered), []
    for step in ordered:
        if remaining <= keep:
            break
        if step not in protected:
            doomed.append(step)
            remaining -= 1
    return doomed


def step_url(store: ckptfs.CheckpointStore, step: int) -> str:
    """The URL that names ``step`` of ``store`` (``state.best_model_checkpoint``, and a value
    ``resume_from_checkpoint`` accepts)."""
    return f"{store.url.rstrip('/')}/{CHECKPOINTS_DIR}/{step_dir_name(step)}"


def trainer_state_value(state: TrainerState) -> dict[str, Any]:
    """``trainer_state.json``'s content as a plain map: what ``TrainerState.save_to_json``
    writes, read back (so exactly the JSON values, no Python objects)."""
    return dict(json.loads(json.dumps(dataclasses.asdict(state), sort_keys=True)))


@dataclass
class _Resume:
    store: ckptfs.CheckpointStore
    step: int
    ref: str
    state: dict[Any, Any]


class CkptfsTrainer(Trainer):  # type: ignore[misc,unused-ignore]  # Any without transformers
    """A ``transformers.Trainer`` that checkpoints into ``checkpoint_url`` with ckptfs.

    ``checkpoint_url``: the run root (any URL ``ckptfs.open`` takes; default
    ``args.output_dir``), or an open `CheckpointStore`.
    ``storage_options`` go to ``ckptfs.open`` (and to stores opened for a step URL of another
    run root given to ``resume_from_checkpoint``).  Everything else is ``Trainer``'s."""

    def __init__(self, *args: Any, checkpoint_url: str | ckptfs.CheckpointStore | None = None,
                 storage_options: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        missing = [m for m in REQUIRED_TRAINER_METHODS if not hasattr(Trainer, m)]
        if missing:
            import transformers
            raise BackendUnavailableError(
                f"ckptfs.transformers needs transformers >= 5.17 (found "
                f"{transformers.__version__}: Trainer lacks {', '.join(missing)}); "
                "install ckptfs[transformers]")
        super().__init__(*args, **kwargs)
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ShardedCheckpointError(
                "CkptfsTrainer does not checkpoint DeepSpeed or FSDP training (their state is "
                "sharded per rank); use the Trainer's own checkpoints, or ckptfs.dcp.Writer "
                "with torch.distributed.checkpoint")
        self._storage_options = dict(storage_options or {})
        url = checkpoint_url if checkpoint_url is not None else str(self.args.output_dir)
        self.checkpoint_store = (url if isinstance(url, ckptfs.CheckpointStore)
                                 else ckptfs.open(url, **self._storage_options))
        self._trial_stores: dict[str, ckptfs.CheckpointStore] = {}
        self._ckptfs_resume: _Resume | None = None
        if self.args.push_to_hub:
            log.warning("CkptfsTrainer: checkpoints are written to %s and are not pushed to the "
                        "Hub (hub_strategy ignored); save_model/push_to_hub still push the model",
                        self.checkpoint_store.url)

    # -- where ------------------------------------------------------------------------------

    def _store_for(self, trial: Any) -> ckptfs.CheckpointStore:
        """The run root, or a sub-root per hyper-parameter-search trial (as ``_get_output_dir``)."""
        if self.hp_search_backend is None or trial is None:
            return self.checkpoint_store
        name = self._get_output_dir(trial).rstrip("/").rsplit("/", 1)[-1]
        if name not in self._trial_stores:
            # A sub-root over the run root's own storage: the same client, retries, write
            # budget and wrappers (a store given as checkpoint_url keeps them for every trial).
            base = self.checkpoint_store
            self._trial_stores[name] = ckptfs.CheckpointStore(
                SubStorage(base.storage, name), algorithm=base.algorithm, durable=base.durable,
                threads=base.threads, shard_bytes=base.shard_bytes)
        return self._trial_stores[name]

    def resolve_checkpoint(self, ref: object) -> tuple[ckptfs.CheckpointStore, int]:
        """The store and committed step that ``resume_from_checkpoint=ref`` means: ``True``
        (the newest committed step), an int step, ``"checkpoint-N"``, or a step URL
        ``<root>/checkpoints/step-<digits>``.  Raises
        `CheckpointNotFoundError` if there is no such committed checkpoint and
        `InvalidStepError` for a value of another form."""
        store = self.checkpoint_store
        if ref is True:
            info = store.latest()
            if info is None:
                raise CheckpointNotFoundError(
                    f"resume_from_checkpoint=True: no committed checkpoint at {store.url}; "
                    "train without it to start the run")
            return store, info.step
        if isinstance(ref, int) and not isinstance(ref, bool):
            step = ref
        elif isinstance(ref, str) and (m := _HF_NAME_RE.match(ref) or re.fullmatch(
                r"(?:step-)?(?P<step>[0-9]+)", ref)):
            step = int(m["step"])
        elif isinstance(ref, str) and (m := _STEP_URL_RE.match(ref)):
            step = int(m["step"])
            root = m["root"]
            if root.rstrip("/") != store.url.rstrip("/"):
                store = ckptfs.open(root, **self._storage_options)
        else:
            raise InvalidStepError(
                f"resume_from_checkpoint={ref!r}: CkptfsTrainer takes True, a step (int), "
                f"'checkpoint-N' or a step URL '<root>/{CHECKPOINTS_DIR}/step-<12 digits>' "
                f"(committed steps at {store.url}: {store.steps()})")
        if step not in store.steps():
            raise CheckpointNotFoundError(
                f"resume_from_checkpoint={ref!r}: step {step} is not a committed checkpoint at "
                f"{store.url} (committed: {store.steps()}); `ckptfs ls {store.url}` lists them")
        return store, step

    # -- saving -----------------------------------------------------------------------------

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        store = self._store_for(trial)
        step = self.state.global_step
        best = self.state.best_global_step
        if (self.args.save_strategy in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST)
                and best and (best == step or best in store.steps())):
            self.state.best_model_checkpoint = step_url(store, best)
        hf: Any = self  # the Trainer's attributes are Optional until training starts
        tree: dict[str, Any] = {"model": hf.model.state_dict()}
        if not self.args.save_only_model:
            tree["optimizer"] = hf.optimizer.state_dict()
            if self.lr_scheduler is not None:
                tree["scheduler"] = self.lr_scheduler.state_dict()
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                tree["scaler"] = scaler.state_dict()
            tree["rng"] = self._gather_rng()
        if self.args.should_save:
            for cb in [c for c in [*self.callback_handler.callbacks, self.control]
                       if isinstance(c, ExportableState)]:
                name = cb.__class__.__name__
                saved: Any = self.state.stateful_callbacks  # a dict of states once created
                if isinstance(saved[name], list):
                    saved[name].append(cb.state())
                else:
                    saved[name] = cb.state()
            tree["trainer_state"] = trainer_state_value(self.state)
            metric = self.state.best_metric
            store.save(step, tree, metadata={"transformers": {
                "global_step": step, "epoch": self.state.epoch,
                "best_metric": metric if metric is not None and math.isfinite(metric) else None,
                "best_global_step": best}})
        self._barrier()
        if self.args.should_save:
            self._rotate(store)

    def _gather_rng(self) -> dict[str, Any]:
        mine = rng.capture()
        world = int(self.args.world_size)
        if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            return rng.pack_ranks(rng.dist_gather(mine, world), world)
        return rng.pack_ranks({int(self.args.process_index): mine}, world)

    def _barrier(self) -> None:
        if int(self.args.world_size) > 1:
            self.accelerator.wait_for_everyone()

    def _best_step(self, store: ckptfs.CheckpointStore) -> int | None:
        ref = self.state.best_model_checkpoint
        m = _STEP_URL_RE.match(ref) if isinstance(ref, str) else None
        if m is None or m["root"].rstrip("/") != store.url.rstrip("/"):
            return None
        return int(m["step"])

    def _rotate(self, store: ckptfs.CheckpointStore) -> None:
        for step in rotation(store.steps(), self.args.save_total_limit, self._best_step(store)):
            log.info("deleting checkpoint step %d at %s (save_total_limit=%s)",
                     step, store.url, self.args.save_total_limit)
            store.delete(step)

    def _finalize_training(self, trial: Any, *args: Any, **kwargs: Any) -> Any:
        hf: Any = super()
        out = hf._finalize_training(trial, *args, **kwargs)
        # The Trainer's own end-of-training rule: save_total_limit=1 keeps only the best.
        store = self._store_for(trial)
        best = self._best_step(store)
        if self.args.should_save and best is not None and self.args.save_total_limit == 1:
            for step in store.steps():
                if step != best:
                    log.info("deleting checkpoint step %d at %s (save_total_limit=1 keeps the "
                             "best, step %d)", step, store.url, best)
                    store.delete(step)
        return out

    # -- resuming ---------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: Any = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """``Trainer.train``; ``resume_from_checkpoint`` as `resolve_checkpoint` takes.
        The checkpoint is loaded and verified before training starts."""
        self._ckptfs_resume = None
        if resume_from_checkpoint is not None and resume_from_checkpoint is not False:
            store, step = self.resolve_checkpoint(resume_from_checkpoint)
            newer = [s for s in self._store_for(trial).steps() if s > step]
            if newer:
                # A committed step is never overwritten (torch.save would): refuse now rather
                # than with CheckpointExistsError at the first save in the middle of training.
                own = self._store_for(trial).url
                raise CheckpointExistsError(
                    f"resume_from_checkpoint={resume_from_checkpoint!r} continues from step "
                    f"{step}, but {own} already has committed steps {newer} that this run would "
                    "save again; resume from the newest (True), write to a new checkpoint_url "
                    f"(resume_from_checkpoint='{step_url(store, step)}' reads from this one), or "
                    f"delete those steps (CheckpointStore.delete) first")
            state = store.load(step)
            ts = state.get("trainer_state")
            if not isinstance(ts, Mapping) or not isinstance(state.get("model"), Mapping):
                raise CorruptCheckpointError(
                    f"step {step} at {store.url} has no 'trainer_state' or 'model' map: it was "
                    "not written by CkptfsTrainer; load it with ckptfs.open(url).load()",
                    step=step)
            self._ckptfs_resume = _Resume(store, step, step_url(store, step), state)
            if ts.get("train_batch_size") is not None and self.args.auto_find_batch_size:
                self._train_batch_size = ts["train_batch_size"]
        try:
            return super().train(resume_from_checkpoint=None, trial=trial,
                                 ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
        finally:
            self._ckptfs_resume = None

    def _inner_training_loop(self, *args: Any, **kwargs: Any) -> Any:
        r = self._ckptfs_resume
        if r is not None:
            # As the base train() does: weights before accelerator.prepare, after model_init.
            self._load_from_checkpoint(r.ref)
            kwargs["resume_from_checkpoint"] = r.ref
        return super()._inner_training_loop(*args, **kwargs)

    def _resume_for(self, checkpoint: str | None) -> _Resume | None:
        r = self._ckptfs_resume
        return r if checkpoint is not None and r is not None and checkpoint == r.ref else None

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int,
                             num_train_epochs: int, resume_from_checkpoint: str | None,
                             trial: Any) -> tuple[int, int]:
        r = self._resume_for(resume_from_checkpoint)
        out: tuple[int, int] = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs,
            None if r is not None else resume_from_checkpoint, trial)
        if r is None:
            return out
        self.state = TrainerState(**dict(r.state["trainer_state"]))
        best = self._best_step(r.store)
        if self.state.best_model_checkpoint is not None and (
                best is None or best not in r.store.steps()):
            log.warning("the best checkpoint %s recorded in the resumed state is not committed "
                        "in %s anymore; ignoring it for this run",
                        self.state.best_model_checkpoint, r.store.url)
            self.state.best_model_checkpoint = None
        compare: Any = compare_trainer_and_checkpoint_args
        compare(self.args, self.state)
        self._load_callback_state()
        epochs_trained = int(self.state.global_step // num_update_steps_per_epoch)
        steps_in_epoch = 0
        if not self.args.ignore_data_skip:
            steps_in_epoch = self.state.global_step % num_update_steps_per_epoch
            steps_in_epoch *= self.args.gradient_accumulation_steps
        state: Any = self.state
        state.init_training_references(self, max_steps, num_train_epochs, trial)
        return epochs_trained, steps_in_epoch

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        r = self._resume_for(resume_from_checkpoint)
        if r is None:
            raise CheckpointNotFoundError(
                f"{resume_from_checkpoint!r} is not the checkpoint this train() resolved; "
                "pass it to CkptfsTrainer.train(resume_from_checkpoint=...)")
        target: Any = self.model if model is None else model
        result = target.load_state_dict(r.state["model"], False)
        self._issue_warnings_after_load(result)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        r = self._resume_for(checkpoint)
        if r is None:
            return
        hf: Any = self
        if "optimizer" in r.state and "scheduler" in r.state:
            hf.optimizer.load_state_dict(r.state["optimizer"])
            hf.lr_scheduler.load_state_dict(r.state["scheduler"])
        else:
            log.warning("step %d at %s has no optimizer/scheduler state (save_only_model?); "
                        "they start fresh", r.step, r.store.url)

    def _load_scaler(self, checkpoint: str | None) -> None:
        r = self._resume_for(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if r is not None and scaler is not None and "scaler" in r.state:
            scaler.load_state_dict(r.state["scaler"])

    def _load_rng_state(self, checkpoint: str | None) -> None:
        r = self._resume_for(checkpoint)
        if r is None:
            return
        if "rng" not in r.state:
            log.info("step %d at %s has no RNG state; the continuation is not reproducible",
                     r.step, r.store.url)
            return
        rng.restore_for_rank(r.state["rng"], rank=int(self.args.process_index),
                             world_size=int(self.args.world_size), run_seed=int(self.args.seed))

    def _load_best_model(self) -> None:
        ref = self.state.best_model_checkpoint
        m = _STEP_URL_RE.match(ref) if isinstance(ref, str) else None
        if m is None:
            log.warning("best_model_checkpoint %r is not a ckptfs step URL; best model not "
                        "loaded", ref)
            return
        root, step = m["root"], int(m["step"])
        store = (self.checkpoint_store if root.rstrip("/") == self.checkpoint_store.url.rstrip("/")
                 else ckptfs.open(root, **self._storage_options))
        log.info("loading the best model from %s (score: %s)", ref, self.state.best_metric)
        model: Any = self.model
        result = model.load_state_dict(store.load(step, keys=["model"])["model"], False)
        self._issue_warnings_after_load(result)


# -- Accelerate ---------------------------------------------------------------------------------
# ``Accelerator.save_state`` writes the optimizer, schedulers, sampler, scaler, RNG and custom
# objects with ``torch.save`` (pickle) into a local folder, with no hook that changes how: it
# cannot be pointed at a store.  These two functions save and restore the same objects (the ones
# ``accelerator.prepare`` and ``register_for_checkpointing`` registered) as one ckptfs checkpoint.


def _accelerate_parts(accelerator: Any) -> dict[str, list[Any]]:
    kind = str(getattr(accelerator, "distributed_type", ""))
    if any(k in kind for k in ("FSDP", "DEEPSPEED", "MEGATRON")):
        raise ShardedCheckpointError(
            f"save/load_accelerate_state do not handle {kind} (sharded per rank); use "
            "accelerator.save_state, or ckptfs.dcp.Writer with torch.distributed.checkpoint")
    return {"models": list(accelerator._models), "optimizers": list(accelerator._optimizers),
            "schedulers": list(accelerator._schedulers),
            "dataloaders": [d for d in accelerator._dataloaders
                            if getattr(d, "use_stateful_dataloader", False)],
            "custom": list(accelerator._custom_objects)}


def _open(target: str | ckptfs.CheckpointStore,
          options: Mapping[str, Any]) -> ckptfs.CheckpointStore:
    return target if isinstance(target, ckptfs.CheckpointStore) else ckptfs.open(target, **options)


def save_accelerate_state(accelerator: Any, target: str | ckptfs.CheckpointStore, step: int, *,
                          metadata: Mapping[str, Any] | None = None,
                          **storage_options: Any) -> ckptfs.CheckpointInfo | None:
    """What ``accelerator.save_state()`` saves, as the checkpoint ``step`` of ``target`` (a
    run-root URL or a store), without pickle: the prepared models' state dicts, optimizers,
    schedulers, stateful dataloaders (``use_stateful_dataloader``), the grad scaler, the objects
    given to ``register_for_checkpointing`` (their ``state_dict()``), ``accelerator.step`` and
    the RNG states of every process.  Call it on every process; the main process writes and
    gets the committed `CheckpointInfo` (the others get ``None``)."""
    parts = _accelerate_parts(accelerator)
    mine = rng.capture()
    world = int(accelerator.num_processes)
    if world > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
        ranks = rng.dist_gather(mine, world)
    else:
        ranks = {int(accelerator.process_index): mine}
    tree: dict[str, Any] = {
        "models": [accelerator.get_state_dict(m, unwrap=False) for m in parts["models"]],
        "optimizers": [o.state_dict() for o in parts["optimizers"]],
        "schedulers": [s.state_dict() for s in parts["schedulers"]],
        "dataloaders": [d.state_dict() for d in parts["dataloaders"]],
        "custom": [o.state_dict() for o in parts["custom"]],
        "accelerate": {"step": int(accelerator.step)},
        "rng": rng.pack_ranks(ranks, world),
    }
    if accelerator.scaler is not None:
        tree["scaler"] = accelerator.scaler.state_dict()
    info = None
    if accelerator.is_main_process:
        info = _open(target, storage_options).save(step, tree, metadata=metadata)
    accelerator.wait_for_everyone()
    return info


def load_accelerate_state(accelerator: Any, target: str | ckptfs.CheckpointStore,
                          step: int | None = None, *, strict: bool = True,
                          **storage_options: Any) -> int:
    """Restore what `save_accelerate_state` saved (``step``, default the newest committed
    one, verified before anything is restored) into the objects ``accelerator`` prepared, in
    the same order, like ``accelerator.load_state()``; returns the step.  The RNG states are
    restored too: when resuming in the middle of an epoch, call it after fetching the first
    batch of the resumed iterator (a DataLoader iterator draws its seed from torch's RNG then;
    the Trainer restores at the same point).  A checkpoint holding
    another number of models, optimizers, ... raises `ProvenanceMismatchError`
    naming them, before anything is restored."""
    store = _open(target, storage_options)
    parts = _accelerate_parts(accelerator)
    if step is None:
        latest = store.latest()
        if latest is None:
            raise CheckpointNotFoundError(f"no committed checkpoint at {store.url} to load")
        step = latest.step
    loaded = step
    state = store.load(step)
    if not isinstance(state.get("accelerate"), Mapping) or not isinstance(state.get("rng"),
                                                                         Mapping):
        raise CorruptCheckpointError(
            f"step {loaded} at {store.url} was not written by save_accelerate_state (no "
            "'accelerate'/'rng' entries); load it with ckptfs.open(url).load()", step=loaded)
    diffs: list[tuple[str, object, object]] = [
        (k, len(state.get(k) or []), len(v)) for k, v in parts.items()
        if len(state.get(k) or []) != len(v)]
    if ("scaler" in state) != (accelerator.scaler is not None):
        diffs.append(("scaler", "scaler" in state, accelerator.scaler is not None))
    if diffs:
        raise ProvenanceMismatchError(
            f"step {loaded} at {store.url} does not match this accelerator: "
            + "; ".join(f"{k}: checkpoint has {a}, prepared {b}" for k, a, b in diffs)
            + "; prepare/register the same objects in the same order", differences=diffs)
    for model, sd in zip(parts["models"], state["models"], strict=True):
        model.load_state_dict(sd, strict=strict)
    for name in ("optimizers", "schedulers", "dataloaders", "custom"):
        for obj, sd in zip(parts[name], state[name], strict=True):
            obj.load_state_dict(sd)
    if accelerator.scaler is not None:
        accelerator.scaler.load_state_dict(state["scaler"])
    accelerator.step = int(state["accelerate"]["step"])
    rng.restore_for_rank(state["rng"], rank=int(accelerator.process_index),
                         world_size=int(accelerator.num_processes), run_seed=0)
    return loaded
