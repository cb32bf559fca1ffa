"""ckptfs.transformers: the Hugging Face Trainer checkpointing into a ckptfs store.

A tiny GPT-2 built from a config (nothing downloaded), random token ids, CPU, a few steps, on
local disk and on S3 (moto).  Checked against the Trainer's own semantics: ``save_total_limit``
keeps the newest and the best, ``load_best_model_at_end`` restores the best step's weights,
``resume_from_checkpoint`` (True, a step, a step URL of another run root) continues bit-exactly.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

transformers = pytest.importorskip("transformers", reason="pip install ckptfs[transformers]")
import torch  # noqa: E402
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,
    TrainingArguments,
)

import ckptfs  # noqa: E402
from ckptfs.storage.base import StorageWrapper  # noqa: E402
from ckptfs.transformers import CkptfsTrainer, rotation, step_url  # noqa: E402

STEPS, EVERY = 12, 3


class TokenData(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, 8), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_model() -> GPT2LMHeadModel:
    torch.manual_seed(1234)
    cfg = GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=64, n_positions=32,
                     resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)  # dropout: RNG matters
    return GPT2LMHeadModel(cfg)


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


class Record(TrainerCallback):  # type: ignore[misc]
    """Weights after every save (the test's own copy, not read from the store), and an
    optional crash right after the checkpoint of ``crash_at`` committed."""

    def __init__(self, crash_at: int | None = None) -> None:
        self.saved: dict[int, dict[str, torch.Tensor]] = {}
        self.crash_at = crash_at
        self.model: torch.nn.Module | None = None

    def on_save(self, args, state, control, model=None, **kw):  # type: ignore[no-untyped-def]
        self.saved[state.global_step] = snapshot(model)
        if state.global_step == self.crash_at:
            raise KeyboardInterrupt(f"simulated preemption after step {self.crash_at}")


def make_trainer(tmp_path, url, options, *, record=None, scores=None, **overrides):  # type: ignore[no-untyped-def]
    kw = dict(output_dir=str(tmp_path / "out"), max_steps=STEPS, save_steps=EVERY,
              per_device_train_batch_size=4, learning_rate=5e-3, warmup_steps=2,
              logging_steps=EVERY, report_to="none", use_cpu=True, seed=7,
              dataloader_num_workers=0, disable_tqdm=True)
    extra = {}
    if scores is not None:
        it = iter(scores)
        kw.update(eval_strategy="steps", eval_steps=EVERY, load_best_model_at_end=True,
                  metric_for_best_model="score", greater_is_better=False)
        extra["compute_metrics"] = lambda p: {"score": next(it)}
    kw.update(overrides)
    args = TrainingArguments(**kw)
    return CkptfsTrainer(model=tiny_model(), args=args, train_dataset=TokenData(48, 0),
                         eval_dataset=TokenData(8, 1) if scores is not None else None,
                         callbacks=[record] if record else None, checkpoint_url=url,
                         storage_options=options, **extra)


@pytest.fixture(autouse=True, scope="module")
def one_thread():  # type: ignore[no-untyped-def]
    """Tiny ops: one intra-op thread is ~4x faster on a shared machine (and deterministic)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(params=["local", "s3"])
def backend(request):  # type: ignore[no-untyped-def]
    return request.getfixturevalue(f"{request.param}_backend")


def test_rotation_rule_matches_the_trainer() -> None:
    assert rotation([3, 6, 9, 12], 2, None) == [3, 6]
    assert rotation([3, 6, 9, 12], 2, 6) == [3, 9]        # newest + best
    assert rotation([3, 6, 9, 12], 2, 12) == [3, 6]       # best is newest: last two
    assert rotation([3, 6, 9, 12], 1, 6) == [3, 9]        # limit 1 with a best: two stay
    assert rotation([3, 6], 3, None) == []
    assert rotation([3, 6, 9], None, 3) == []


def test_save_total_limit_and_best_model(tmp_path, backend) -> None:  # type: ignore[no-untyped-def]
    rec = Record()
    # Scripted eval scores (lower is better): the best is step 6, not the newest.
    tr = make_trainer(tmp_path, backend.url, backend.options, record=rec,
                      scores=[3.0, 1.0, 2.0, 4.0], save_total_limit=2)
    tr.train()
    store = backend.open()
    assert store.steps() == [6, 12]                        # newest + best, nothing else
    assert store.all_steps() == [6, 12]                    # deleted entirely, no leftovers
    assert tr.state.best_model_checkpoint == step_url(store, 6)
    assert sorted(rec.saved) == [3, 6, 9, 12]
    assert not same(rec.saved[6], rec.saved[12])
    assert same(snapshot(tr.model), rec.saved[6])          # load_best_model_at_end
    state = store.load(12)
    assert same(state["model"], rec.saved[12])
    assert state["trainer_state"]["global_step"] == 12
    assert state["trainer_state"]["best_model_checkpoint"] == step_url(store, 6)
    assert set(state) == {"model", "optimizer", "scheduler", "rng", "trainer_state"}
    assert not list((tmp_path / "out").glob("checkpoint-*"))   # nothing written locally


def test_save_total_limit_one_keeps_only_the_best_at_the_end(tmp_path, local_backend) -> None:  # type: ignore[no-untyped-def]
    rec = Record()
    seen: list[list[int]] = []
    store = local_backend.open()

    class Watch(TrainerCallback):  # type: ignore[misc]
        def on_save(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
            seen.append(store.steps())

    tr = make_trainer(tmp_path, local_backend.url, {}, record=rec, scores=[3.0, 1.0, 2.0, 4.0],
                      save_total_limit=1)
    tr.add_callback(Watch())
    tr.train()
    assert seen == [[3], [6], [6, 9], [6, 12]]            # newest + best during training
    assert store.steps() == [6]                           # only the best at the end
    assert same(snapshot(tr.model), rec.saved[6])


def test_resume_is_bit_exact(tmp_path, backend) -> None:  # type: ignore[no-untyped-def]
    ref = Record()
    make_trainer(tmp_path / "a", backend.sibling("ref").url, backend.options, record=ref).train()

    crashed = Record(crash_at=9)
    with pytest.raises(KeyboardInterrupt):
        make_trainer(tmp_path / "b", backend.url, backend.options, record=crashed).train()
    store = backend.open()
    assert store.steps() == [3, 6, 9]
    assert same(crashed.saved[9], ref.saved[9])

    # True: the newest committed step (9), in a new trainer whose model starts elsewhere.
    resumed = Record()
    tr = make_trainer(tmp_path / "b", backend.url, backend.options, record=resumed)
    tr.train(resume_from_checkpoint=True)
    assert tr.state.global_step == STEPS
    assert sorted(resumed.saved) == [12]
    assert same(snapshot(tr.model), ref.saved[12])

    # A specific older step of that run, continued into another run root, by step URL.
    other = backend.sibling("from6")
    tr = make_trainer(tmp_path / "c", other.url, backend.options, record=Record())
    tr.train(resume_from_checkpoint=step_url(store, 6))
    assert same(snapshot(tr.model), ref.saved[12])
    assert other.open().steps() == [9, 12]

    # Control (once: it is about the model, not the storage): without its RNG state the
    # continuation differs (dropout draws from torch's generator).
    if backend.name != "local":
        return
    tr = make_trainer(tmp_path / "d", backend.sibling("norng").url, backend.options)
    tr._load_rng_state = lambda checkpoint: None  # type: ignore[method-assign]
    tr.train(resume_from_checkpoint=step_url(store, 6))
    assert not same(snapshot(tr.model), ref.saved[12])


def test_resume_refusals(tmp_path, local_backend) -> None:  # type: ignore[no-untyped-def]
    make_trainer(tmp_path, local_backend.url, {}, max_steps=6).train()
    store = local_backend.open()
    assert store.steps() == [3, 6]
    before = store.all_steps()
    tr = make_trainer(tmp_path, local_backend.url, {})
    for older in (3, "checkpoint-3", step_url(store, 3)):
        with pytest.raises(ckptfs.CheckpointExistsError, match=r"\[6\]"):
            tr.train(resume_from_checkpoint=older)       # would save step 6 again
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="step 4"):
        tr.train(resume_from_checkpoint=4)
    with pytest.raises(ckptfs.InvalidStepError, match="checkpoint-N"):
        tr.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint"))
    with pytest.raises(ckptfs.CheckpointNotFoundError, match="no committed checkpoint"):
        make_trainer(tmp_path, local_backend.sibling().url, {}).train(resume_from_checkpoint=True)
    assert store.all_steps() == before


def test_plain_checkpoint_is_refused_for_resume(tmp_path, local_backend) -> None:  # type: ignore[no-untyped-def]
    store = local_backend.open()
    store.save(3, {"weights": torch.zeros(2)})
    tr = make_trainer(tmp_path, local_backend.url, {})
    with pytest.raises(ckptfs.CorruptCheckpointError, match="trainer_state"):
        tr.train(resume_from_checkpoint=True)


class _Recording(StorageWrapper):
    """A storage wrapper standing for what a user's store may carry (credentials, retries, a
    fault injector): records every path written through it."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.written: list[str] = []

    def open_write(self, path: str) -> Any:
        self.written.append(path)
        return super().open_write(path)

    def create_exclusive(self, path: str, data: bytes) -> None:
        self.written.append(path)
        super().create_exclusive(path, data)


def test_trial_stores_share_the_run_roots_storage(tmp_path, memory_backend,  # type: ignore[no-untyped-def]
                                                 monkeypatch) -> None:
    """A hyper-parameter-search trial checkpoints into a sub-root of checkpoint_url through
    the same storage object (a store given as checkpoint_url keeps its client and wrappers),
    not through a second client opened from the URL alone."""
    recording = _Recording(memory_backend.open().storage)
    root = ckptfs.CheckpointStore(recording)
    tr = make_trainer(tmp_path, root, {})
    monkeypatch.setattr(tr, "hp_search_backend", "optuna")
    monkeypatch.setattr(tr, "_get_output_dir", lambda trial: str(tmp_path / "out" / "run-7"))
    sub = tr._store_for(object())
    assert sub.url == f"{root.url}/run-7" and tr._store_for(object()) is sub
    sub.save(3, {"w": torch.ones(2)})
    assert recording.written and all(p.startswith("run-7/checkpoints/") for p in
                                      recording.written)
    assert ckptfs.open(f"{memory_backend.url}/run-7").steps() == [3]


# -- Accelerate ---------------------------------------------------------------------------------


class Counter:
    """A registered custom object (``accelerator.register_for_checkpointing``)."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict[str, int]:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.seen = int(sd["seen"])


def accelerate_run(target, options, *, stop: int, save_at: int | None = None,  # type: ignore[no-untyped-def]
                   resume: bool = False):
    from accelerate import Accelerator
    from accelerate.data_loader import skip_first_batches

    from ckptfs.transformers import load_accelerate_state, save_accelerate_state

    acc = Accelerator(cpu=True)
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    dl = torch.utils.data.DataLoader(TokenData(48, 0), batch_size=4)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    counter = Counter()
    acc.register_for_checkpointing(counter)
    torch.manual_seed(99)
    start, batches = 0, iter(dl)
    if resume:
        # As the Trainer does: restore after the iterator drew its seed from torch's RNG
        # (a DataLoader iterator does, when its first batch is fetched).
        start = ckptfs.open(target, **options).latest().step
        batches = iter(skip_first_batches(dl, start))
        first = next(batches)
        assert load_accelerate_state(acc, target, **options) == start
        batches = itertools.chain([first], batches)
    model.train()
    for i, batch in enumerate(batches, start=start):
        if i == stop:
            break
        loss = model(**batch).loss
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        counter.seen += 1
        if i + 1 == save_at:
            save_accelerate_state(acc, target, i + 1, **options)
    return snapshot(acc.unwrap_model(model)), counter.seen, acc, opt


def test_accelerate_state_round_trip_is_bit_exact(backend) -> None:  # type: ignore[no-untyped-def]
    ref, _, _, _ = accelerate_run(backend.sibling("ref").url, backend.options, stop=10)
    accelerate_run(backend.url, backend.options, stop=6, save_at=6)      # "preempted" at 6
    store = backend.open()
    assert store.steps() == [6]
    state = store.load(6)
    assert set(state) == {"models", "optimizers", "schedulers", "dataloaders", "custom",
                          "accelerate", "rng"}
    assert state["custom"] == [{"seen": 6}]
    weights, seen, _, opt = accelerate_run(backend.url, backend.options, stop=10, resume=True)
    assert seen == 10                                    # the custom object was restored
    assert opt.state_dict()["state"][0]["step"].item() == 10   # and the optimizer's step
    assert same(weights, ref)                            # bit-exact continuation


def test_accelerate_load_refuses_another_setup(local_backend) -> None:  # type: ignore[no-untyped-def]
    from accelerate import Accelerator

    from ckptfs.transformers import load_accelerate_state, save_accelerate_state

    acc = Accelerator(cpu=True)
    acc.prepare(tiny_model())
    with pytest.raises(ckptfs.CheckpointNotFoundError):
        load_accelerate_state(acc, local_backend.url)
    save_accelerate_state(acc, local_backend.url, 1)
    acc2 = Accelerator(cpu=True)
    fresh = tiny_model()
    m2, _ = acc2.prepare(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    before = snapshot(m2)
    with pytest.raises(ckptfs.ProvenanceMismatchError, match="optimizers: checkpoint has 0"):
        load_accelerate_state(acc2, local_backend.url)
    assert same(snapshot(m2), before)                    # nothing restored
