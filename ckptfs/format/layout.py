"""Names and layout of format v1.  Pure: no I/O, no storage, no clock.

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
STEP_PREFIX = "step-"
STEP_DIGITS = 12
MAX_STEP = 10**STEP_DIGITS - 1
ATTEMPT_PREFIX = "a-"
TMP_PREFIX = ".tmp-"

_STEP_RE = re.compile(r"^step-(\d{12,})$")
_ATTEMPT_RE = re.compile(r"^a-(\d{8}T\d{6}Z)-([0-9a-f]{8,32})$")


def check_step(step: object) -> int:
    """Return ``step`` if it is a valid step number, else raise :class:`InvalidStepError`."""
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
    """The step of a step directory name, or ``None`` if ``name`` is not one (ignored)."""
    m = _STEP_RE.match(name.rstrip("/").rsplit("/", 1)[-1])
    if m is None:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def new_attempt_name(now: datetime | None = None, token: str | None = None) -> str:
    """A fresh attempt name, unique per writer: UTC time + 64 random bits."""
    now = now or datetime.now(timezone.utc)
    token = token or secrets.token_hex(8)
    return f"{ATTEMPT_PREFIX}{now.strftime('%Y%m%dT%H%M%SZ')}-{token}"


def parse_attempt_name(name: str) -> datetime | None:
    """The creation time encoded in an attempt name, or ``None`` if not an attempt name."""
    m = _ATTEMPT_RE.match(name)
    if m is None:
        return None
    return datetime.strptime(m.group(1), "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc)


def is_attempt_name(name: str) -> bool:
    return _ATTEMPT_RE.match(name) is not None


def tmp_attempt_name(attempt: str) -> str:
    return f"{TMP_PREFIX}{attempt}"


def tensor_file_name(index: int) -> str:
    return TENSOR_FILE_TEMPLATE.format(index=index)


@dataclass(frozen=True)
class StepPaths:
    """Paths of one step, relative to the run root (always ``/``-separated)."""

    step: int

    @property
    def dir(self) -> str:
        return f"{CHECKPOINTS_DIR}/{step_dir_name(self.step)}"

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


_SAFE_COMPONENT = re.compile(r"^[A-Za-z0-9._-]+$")


def check_relpath(relpath: object) -> str:
    """Validate a path found in a manifest: relative, ``/``-separated, no ``..``/``.``, no
    backslash, NUL, colon (URL schemes, drive letters) or leading dot components.

    Raises :class:`UnsafeCheckpointError`; a checkpoint can never name a file outside itself.
    """
    if not isinstance(relpath, str) or not relpath or len(relpath) > 512:
        raise UnsafeCheckpointError(f"manifest path {relpath!r} is not a short non-empty string")
    parts = relpath.split("/")
    for part in parts:
        if part in ("", ".", "..") or part.startswith(".") or not _SAFE_COMPONENT.match(part):
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
