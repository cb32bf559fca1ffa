"""The torch versions ckptfs supports, without importing torch.

Two floors, each the oldest version its tests run on (docs/installation.md lists the tested
versions; ``scripts/run-torch-matrix.sh`` runs them in CI):

- `TORCH_FLOOR` (2.6), what ``pyproject.toml`` declares: single-process saves and loads
  (format v1 and v3 checkpoints: ``store.save``/``load``, ``save_async``, the manager,
  ``ckptfs cp``, replication, verify, export) use public torch APIs only.
- `SHARDED_TORCH_FLOOR` (2.9): sharded checkpoints (formats v2, v4, v5: collective saves,
  ``layout="ranks"``, DTensor states, ``ckptfs.dcp``) use a few private DCP and DTensor APIs,
  all looked up in ``ckptfs/torch_compat.py``, which refuses an older torch with
  ``TorchCompatError`` when imported.  Below 2.9, FSDP2 does not train right on the CPU and
  DCP lacks hooks ckptfs's planner overrides (docs/installation.md, "Why two floors").
"""

from __future__ import annotations

import re
import sys

#: The oldest torch ckptfs installs with (pyproject.toml): single-process checkpoints.
TORCH_FLOOR = (2, 6)
#: The oldest torch ckptfs's sharded checkpoints (and ckptfs.dcp) run on.
SHARDED_TORCH_FLOOR = (2, 9)


def torch_version(text: str | None = None) -> tuple[int, int]:
    """(major, minor) of ``text`` (``"2.13.0+cpu"`` -> (2, 13)), or of the installed torch's
    ``torch.__version__`` (imports torch) when ``text`` is None."""
    if text is None:
        import torch

        text = str(torch.__version__)
    m = re.match(r"(\d+)\.(\d+)", text)
    if m is None:  # pragma: no cover - torch always has a version
        return (0, 0)
    return int(m.group(1)), int(m.group(2))


def floor_text(floor: tuple[int, int]) -> str:
    """``(2, 9)`` -> ``"2.9"``."""
    return f"{floor[0]}.{floor[1]}"


def sharded_supported(text: str | None = None) -> bool:
    """Whether the installed torch (or ``text``) is new enough for sharded checkpoints."""
    return torch_version(text) >= SHARDED_TORCH_FLOOR


__all__ = ["SHARDED_TORCH_FLOOR", "TORCH_FLOOR", "floor_text", "sharded_supported",
           "torch_version"]

if __name__ == "__main__":  # pragma: no cover - a shell helper: python -m ckptfs.torch_versions
    print(floor_text(TORCH_FLOOR), floor_text(SHARDED_TORCH_FLOOR), file=sys.stdout)
