"""Resume provenance: refuse to resume a run under a different config or different inputs.

A checkpoint records, in its manifest metadata (``provenance``)::

    {"config": "sha256:...",                      fingerprint of the run config (canonical JSON)
     "fingerprints": {"data": "...", "code": "...", "tokenizer": "..."},
     "execution": {"world_size": 8, "hardware": "8xH100"},
     "changes": [ {"key": "execution.world_size", "from": 4, "to": 8, "at_step": 1000} ]}

Restoring with ``expect=`` compares the flattened keys (``config``, ``fingerprints.<name>``,
``execution.<name>``) of the expected provenance with the checkpoint's:

- ``mode="exact"``: any difference refuses the resume with
  `ProvenanceMismatchError`, whose message and ``differences`` list every
  differing key as (key, expected, actual); the same report is written to the store as a
  diagnostic record ``lifecycle/diagnostics/provenance-<UTC time>-<token>.json`` so the refusal
  is visible to whoever inspects the run later;
- ``mode="execution_change"``: differences in ``execution.*`` keys (world size, hardware) are
  accepted as declared changes and recorded in the next checkpoint's ``changes``; any other
  difference still refuses.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Literal

from ckptfs.errors import ProvenanceMismatchError, UnsupportedValueError
from ckptfs.format.hashing import digest_bytes
from ckptfs.lifecycle.records import LIFECYCLE_DIR
from ckptfs.storage.base import Storage

ProvenanceMode = Literal["exact", "execution_change"]
DIAGNOSTICS_DIR = f"{LIFECYCLE_DIR}/diagnostics"


def fingerprint(value: Any) -> str:
    """``sha256:<hex>`` of ``value``'s canonical JSON (sorted keys, no spaces): equal configs
    give equal fingerprints however they were built."""
    try:
        data = json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False,
                          default=_default)
    except (TypeError, ValueError) as exc:
        raise UnsupportedValueError(f"cannot fingerprint the run config: {exc}; use plain "
                                    "JSON values (or a precomputed fingerprint string)") from None
    return digest_bytes("sha256", data.encode())


def _default(obj: Any) -> Any:
    if isinstance(obj, (set, frozenset)):
        return sorted(obj)
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    raise TypeError(f"{type(obj).__name__} is not JSON-serializable")


@dataclass(frozen=True)
class Provenance:
    """What a run is: its config (fingerprinted), named input fingerprints, and execution facts
    that may legitimately change on resume (world size, hardware)."""

    config: Any = None
    fingerprints: Mapping[str, str] = field(default_factory=dict)
    execution: Mapping[str, Any] = field(default_factory=dict)

    @property
    def config_fingerprint(self) -> str | None:
        if self.config is None:
            return None
        if isinstance(self.config, str) and self.config.startswith("sha256:"):
            return self.config
        return fingerprint(self.config)

    def to_record(self) -> dict[str, Any]:
        return {"config": self.config_fingerprint,
                "fingerprints": {str(k): str(v) for k, v in self.fingerprints.items()},
                "execution": json.loads(json.dumps(dict(self.execution), default=str))}

    def flat(self) -> dict[str, Any]:
        return flatten(self.to_record())


def malformed(record: object) -> str | None:
    """Why a recorded provenance does not have the shape `Provenance.to_record` writes
    (``config`` a string or null, ``fingerprints`` and ``execution`` maps with string keys),
    or ``None``."""
    if not isinstance(record, Mapping):
        return f"a {type(record).__name__}, not a map"
    if record.get("config") is not None and not isinstance(record.get("config"), str):
        return "'config' is not a fingerprint string"
    for section in ("fingerprints", "execution"):
        value = record.get(section)
        if value is not None and not (isinstance(value, Mapping)
                                      and all(isinstance(k, str) for k in value)):
            return f"{section!r} is not a map with string keys"
    return None


def flatten(record: Mapping[str, Any] | None) -> dict[str, Any]:
    """``{"config": ..., "fingerprints.data": ..., "execution.world_size": ...}``."""
    if not record:
        return {}
    if malformed(record) is not None:
        raise ProvenanceMismatchError(
            f"malformed provenance record: {malformed(record)}",
            differences=[("provenance", "a provenance record", malformed(record))])
    out: dict[str, Any] = {}
    if record.get("config") is not None:
        out["config"] = record.get("config")
    for section in ("fingerprints", "execution"):
        for k, v in dict(record.get(section) or {}).items():
            out[f"{section}.{k}"] = v
    return out


_MISSING = "<absent>"


def compare(expected: Provenance, recorded: Mapping[str, Any] | None
            ) -> list[tuple[str, Any, Any]]:
    """Every differing key as (key, expected, actual-in-checkpoint), sorted by key."""
    exp = expected.flat()
    act = flatten(recorded)
    diffs = []
    for key in sorted(set(exp) | set(act)):
        e, a = exp.get(key, _MISSING), act.get(key, _MISSING)
        if e != a:
            diffs.append((key, e, a))
    return diffs


def check(storage: Storage, expected: Provenance, recorded: Mapping[str, Any] | None, *,
          step: int, mode: ProvenanceMode = "exact") -> list[dict[str, Any]]:
    """Check ``expected`` against a checkpoint's recorded provenance.  Returns the accepted
    execution changes (for the next checkpoint); raises `ProvenanceMismatchError` and
    writes a diagnostic record when the resume must be refused."""
    if mode not in ("exact", "execution_change"):
        raise ValueError(f"provenance mode must be 'exact' or 'execution_change', got {mode!r}")
    problem = malformed(recorded) if recorded is not None else None
    diffs: list[tuple[str, Any, Any]]
    if recorded is None:
        diffs = [("provenance", "recorded", "the checkpoint records no provenance")]
    elif problem is not None:
        diffs = [("provenance", "a provenance record", f"malformed: {problem}")]
    else:
        diffs = compare(expected, recorded)
    accepted: list[dict[str, Any]] = []
    refused: list[tuple[str, object, object]] = []
    for key, e, a in diffs:
        if mode == "execution_change" and key.startswith("execution."):
            accepted.append({"key": key, "from": a, "to": e, "at_step": step})
        else:
            refused.append((key, e, a))
    if not refused:
        return accepted
    where = write_diagnostic(storage, step=step, mode=mode, differences=refused,
                             expected=expected.to_record(), recorded=recorded)
    lines = "\n".join(f"  {k}: expected {e!r}, checkpoint has {a!r}" for k, e, a in refused)
    hint = ("declare execution changes with mode='execution_change'; "
            if any(k.startswith("execution.") for k, _, _ in refused) and mode == "exact"
            else "")
    raise ProvenanceMismatchError(
        f"refusing to resume step {step} at {storage.url}: provenance differs ({mode} mode) in "
        f"{len(refused)} key(s):\n{lines}\n{hint}resume with the original config and inputs, "
        f"or start a new run root. Report written to {storage.url}/{where}",
        differences=refused, diagnostic=where)


def write_diagnostic(storage: Storage, *, step: int, mode: str,
                     differences: list[tuple[str, Any, Any]], expected: Any,
                     recorded: Any) -> str:
    now = datetime.now(timezone.utc)
    path = (f"{DIAGNOSTICS_DIR}/provenance-{now.strftime('%Y%m%dT%H%M%SZ')}-"
            f"{secrets.token_hex(4)}.json")
    doc = {"schema": "ckptfs.provenance-refusal", "version": 1, "step": step, "mode": mode,
           "time": now.isoformat(timespec="seconds"),
           "differences": [{"key": k, "expected": e, "actual": a} for k, e, a in differences],
           "expected": expected, "recorded": recorded}
    storage.create_exclusive(path, json.dumps(doc, indent=2, sort_keys=True,
                                              default=str).encode())
    return path
