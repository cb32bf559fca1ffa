"""Names and layout of format v1 (and the names format v2 adds: `METADATA_NAME`, the rank
files of `rank_file_name`).  Pure: no I/O, no storage, no clock.

Everything that names a file of the protocol lives here, so the writer, the reader, the
garbage collector and the spec (docs/protocol.md) agree on one set of constants::

    <run root>/
      checkpoints/
        step-000000001000/                  one directory per step: "step-" + 12-digit step
          COMPLETE                          commit marker (JSON), created last, exclusively
          a-20261130T012500Z-3f9c2a1b/      one attempt: a single writer's files
            MANIFEST.json                   every file: path, size, digest, algorithm
            state.msgpack                   the state tree; tensors referenced by name
            tensors-00000.safetensors       tensor bytes, opened by the safetensors library
          a-20261130T013000Z-77e01d9c/      an attempt that never committed (crashed/lost race)
          .tmp-a-.../                       local disk only: an attempt before its rename

A step is *committed* iff ``COMPLETE`` exists, parses, names an attempt of this step, and the
digest it records equals the digest of that attempt's ``MANIFEST.json``.

Names are matched as whole strings of ASCII characters (``fullmatch``, ``[0-9]``).  A step
directory may have more than 12 digits (extra leading zeros: a non-canonical name of the same
step); code that lists directories addresses them by the listed name (`StepPaths` with
``name``), never by a name rebuilt from the step.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass
from datetime import datetime, timezone

from ckptfs.errors import InvalidStepError, UnsafeCheckpointError

FORMAT_VERSION = 1
CHECKPOINTS_DIR = "checkpoints"
MARKER_NAME = "COMPLETE"
MANIFEST_NAME = "MANIFEST.json"
STATE_NAME = "state.msgpack"
TENSOR_FILE_TEMPLATE = "tensors-{index:05d}.safetensors"
#: DCP's global metadata in a sharded attempt (format v2, docs/protocol.md §8).
METADATA_NAME = "dcp.msgpack"
STEP_PREFIX = "step-"
STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS - 1
ATTEMPT_PREFIX = "a-"
TMP_PREFIX = ".tmp-"

# Whole-string matches of ASCII digits only: ``\d`` would admit Unicode digits ("step-١٢...")
# and ``$`` a trailing newline; every name below is matched with ``fullmatch``.
_STEP_RE = re.compile(r"step-([0-9]{12,})")
_RANK_FILE = re.compile(r"rank-([0-9]{5,})/data-([0-9]+)\.safetensors")
_ATTEMPT_RE = re.compile(r"a-([0-9]{8}T[0-9]{6}Z)-([0-9a-f]{8,32})")


def check_step(step: object) -> int:
    """Return ``step`` if it is a valid step number, else raise `InvalidStepError`."""
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidStepError(
            f"step must be a non-negative int, got {type(step).__name__} {step!r}; "
            "pass the training step counter as an int"
        )
    if step < 0 or step > MAX_STEP:
        raise InvalidStepError(f"step must be in [0, {MAX_STEP}], got {step}")
    return step


def step_dir_name(step: int) -> str:
    """``step-000000001000`` for step 1000: zero-padded so names also sort, but readers order
    by the parsed integer, never by the string."""
    return f"{STEP_PREFIX}{check_step(step):0{STEP_DIGITS}d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a step directory name, or ``None`` if ``name`` is not one (ignored).

    ``step-`` followed by 12 or more ASCII digits whose value is at most `MAX_STEP`, as a
    whole string.  More than 12 digits (extra leading zeros) is a valid but non-canonical
    name: callers must use the name they listed, never rebuild it from the step
    (`StepPaths` takes it), and two names of one step are an error for the reader."""
    m = _STEP_RE.fullmatch(name.rstrip("/").rsplit("/", 1)[-1])
    if m is None:
        return None
    digits = m.group(1).lstrip("0") or "0"
    if len(digits) > STEP_DIGITS:  # over MAX_STEP (and never int() a huge string)
        return None
    return int(digits)


def is_canonical_step_dir(name: str) -> bool:
    """``name`` is the name a writer gives its step (exactly 12 digits)."""
    step = parse_step_dir(name)
    return step is not None and name.rstrip("/").rsplit("/", 1)[-1] == step_dir_name(step)


def new_attempt_name(now: datetime | None = None, token: str | None = None) -> str:
    """A fresh attempt name, unique per writer: UTC time + 64 random bits."""
    now = now or datetime.now(timezone.utc)
    token = token or secrets.token_hex(8)
    return f"{ATTEMPT_PREFIX}{now.strftime('%Y%m%dT%H%M%SZ')}-{token}"


def parse_attempt_name(name: str) -> datetime | None:
    """The creation time encoded in an attempt name, or ``None`` if not an attempt name or its
    time is not a valid calendar time (``a-20261399T999999Z-...``: garbage collection, which
    ages attempts by this time, then leaves the directory alone)."""
    m = _ATTEMPT_RE.fullmatch(name)
    if m is None:
        return None
    try:
        return datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)
    except ValueError:
        return None


def is_attempt_name(name: str) -> bool:
    """``name`` matches the attempt pattern as a whole string (the check readers apply to the
    ``attempt`` of a marker and a manifest)."""
    return _ATTEMPT_RE.fullmatch(name) is not None


def tmp_attempt_name(attempt: str) -> str:
    return f"{TMP_PREFIX}{attempt}"


def rank_file_name(rank: int, index: int = 0) -> str:
    """``rank-00003/data-0.safetensors``: the data file ``index`` of ``rank`` (format v2)."""
    return f"rank-{rank:05d}/data-{index}.safetensors"


def rank_of_file(path: str) -> int | None:
    """The rank whose data file ``path`` is, if ``path`` is exactly the name
    `rank_file_name` gives it (canonical: 5 or more digits, no extra zeros), else
    ``None``."""
    m = _RANK_FILE.fullmatch(path)
    if m is None:
        return None
    rank, index = int(m.group(1)), int(m.group(2))
    return rank if rank_file_name(rank, index) == path else None


#: Format v5 (``rank-metadata``): the tensor spec, written by the coordinator.
SPEC_NAME = "dcp-spec.msgpack"


def rank_index_name(rank: int) -> str:
    """``rank-00003/index.msgpack``: the index document of ``rank`` (format v5), beside its
    data file."""
    return f"rank-{rank:05d}/index.msgpack"


def table_block_name(block: int) -> str:
    """``rank-table/block-00000.bin``: the ``block``-th block of the table of rank files
    (format v5)."""
    return f"rank-table/block-{block:05d}.bin"


def tensor_file_name(index: int) -> str:
    return TENSOR_FILE_TEMPLATE.format(index=index)


@dataclass(frozen=True)
class StepPaths:
    """Paths of one step, relative to the run root (always ``/``-separated).

    ``name`` is the step directory's name as it was listed; empty means the canonical name a
    writer creates (`step_dir_name`).  Code that found a step by listing must pass the
    listed name: a non-canonical name (``step-0000000000020``) rebuilt from its step would
    address another directory."""

    step: int
    name: str = ""

    def __post_init__(self) -> None:
        if self.name and parse_step_dir(self.name) != self.step:
            raise InvalidStepError(f"{self.name!r} is not a directory name of step {self.step}")

    @classmethod
    def of(cls, name: str) -> StepPaths:
        """The paths of the step directory ``name`` (a listed name)."""
        step = parse_step_dir(name)
        if step is None:
            raise InvalidStepError(f"{name!r} is not a step directory name")
        return cls(step, name.rstrip("/").rsplit("/", 1)[-1])

    @property
    def dir_name(self) -> str:
        return self.name or step_dir_name(self.step)

    @property
    def dir(self) -> str:
        return f"{CHECKPOINTS_DIR}/{self.dir_name}"

    @property
    def marker(self) -> str:
        return f"{self.dir}/{MARKER_NAME}"

    def attempt_dir(self, attempt: str) -> str:
        return f"{self.dir}/{attempt}"

    def tmp_attempt_dir(self, attempt: str) -> str:
        return f"{self.dir}/{tmp_attempt_name(attempt)}"

    def manifest(self, attempt: str) -> str:
        return f"{self.attempt_dir(attempt)}/{MANIFEST_NAME}"

    def file(self, attempt: str, relpath: str) -> str:
        return f"{self.attempt_dir(attempt)}/{check_relpath(relpath)}"


_SAFE_COMPONENT = re.compile(r"[A-Za-z0-9._-]+")  # fullmatch: no trailing newline


def check_relpath(relpath: object) -> str:
    """Validate a path found in a manifest: relative, ``/``-separated, no ``..``/``.``, no
    backslash, NUL, colon (URL schemes, drive letters) or leading dot components.

    Raises `UnsafeCheckpointError`; a checkpoint can never name a file outside itself.
    """
    if not isinstance(relpath, str) or not relpath or len(relpath) > 512:
        raise UnsafeCheckpointError(f"manifest path {relpath!r} is not a short non-empty string")
    parts = relpath.split("/")
    for part in parts:
        if part in ("", ".", "..") or part.startswith(".") or not _SAFE_COMPONENT.fullmatch(part):
            raise UnsafeCheckpointError(
                f"manifest path {relpath!r} is not a safe relative path inside the checkpoint "
                "(absolute, '..', backslash, NUL, scheme or hidden component); refusing to read it"
            )
    if relpath in (MANIFEST_NAME, MARKER_NAME):
        raise UnsafeCheckpointError(f"manifest path {relpath!r} names a protocol file")
    return relpath


def sanitize_component(text: str, limit: int = 40) -> str:
    """A file-name-safe rendering of a user key (for readable shard names)."""
    out = re.sub(r"[^A-Za-z0-9_-]+", "_", text).strip("_")
    return out[:limit] or "x"
