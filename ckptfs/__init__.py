"""ckptfs: crash-consistent PyTorch training checkpoints on any fsspec storage.

>>> import ckptfs
>>> store = ckptfs.open("file:///data/runs/exp1")        # or memory://, s3://, gs://, az://
>>> info = store.save(1000, {"model": model.state_dict(), "trainer": {"step": 1000}})
>>> state = store.load()                                # newest committed, verified as read

The on-storage format is specified in docs/protocol.md.

The errors are imported with the package; every other name (``open``, ``CheckpointManager``,
...) is imported from its module on first use (PEP 562 ``__getattr__``), so that what needs
none of them (``ckptfs --version``, every ``--help`` of the command) does not import torch.
``from ckptfs import open`` and ``ckptfs.open`` work as with eager imports; type checkers see
the imports under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ckptfs.errors import (
    ArtifactConflictError,
    ArtifactMismatchError,
    AsyncSaveError,
    BackendUnavailableError,
    CheckpointDeletedError,
    CheckpointExistsError,
    CheckpointKeyError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    ExportExistsError,
    ExtensionTypeError,
    FormatVersionError,
    HashAlgorithmUnavailableError,
    InvalidStepError,
    InvalidURLError,
    LoadOptionError,
    ProvenanceMismatchError,
    RemoteChecksumMismatchError,
    ReplicationError,
    RngStateError,
    SaveOptionError,
    ShardedCheckpointError,
    ShardedLoadError,
    ShardedSaveError,
    StagingBudgetError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
    TierMismatchError,
    TierOverlapError,
    UnreplicatedCheckpointError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)

if TYPE_CHECKING:
    from ckptfs.format.extensions import register_type
    from ckptfs.format.hashing import ALGORITHMS, DEFAULT_ALGORITHM, available_algorithms
    from ckptfs.format.layout import FORMAT_VERSION
    from ckptfs.lifecycle.manager import CheckpointManager, SaveResult, TrainerState
    from ckptfs.lifecycle.provenance import Provenance
    from ckptfs.lifecycle.retention import Best, RetentionPolicy
    from ckptfs.protocol.async_save import AsyncStats, SaveFuture
    from ckptfs.protocol.hf_export import HfExport, export_hf
    from ckptfs.protocol.reader import VerifyReport
    from ckptfs.protocol.replication import ReplicationStatus, StepReplication
    from ckptfs.protocol.resolve import CheckpointInfo
    from ckptfs.protocol.store import CheckpointStore, open
    from ckptfs.protocol.tiers import TieredStore, tiered
    from ckptfs.storage.base import Capabilities

__version__ = "0.1.0"

#: The names imported on first use: name -> the module that defines it.
_LAZY: dict[str, str] = {
    "register_type": "ckptfs.format.extensions",
    "ALGORITHMS": "ckptfs.format.hashing",
    "DEFAULT_ALGORITHM": "ckptfs.format.hashing",
    "available_algorithms": "ckptfs.format.hashing",
    "FORMAT_VERSION": "ckptfs.format.layout",
    "CheckpointManager": "ckptfs.lifecycle.manager",
    "SaveResult": "ckptfs.lifecycle.manager",
    "TrainerState": "ckptfs.lifecycle.manager",
    "Provenance": "ckptfs.lifecycle.provenance",
    "Best": "ckptfs.lifecycle.retention",
    "RetentionPolicy": "ckptfs.lifecycle.retention",
    "AsyncStats": "ckptfs.protocol.async_save",
    "SaveFuture": "ckptfs.protocol.async_save",
    "HfExport": "ckptfs.protocol.hf_export",
    "export_hf": "ckptfs.protocol.hf_export",
    "VerifyReport": "ckptfs.protocol.reader",
    "ReplicationStatus": "ckptfs.protocol.replication",
    "StepReplication": "ckptfs.protocol.replication",
    "CheckpointInfo": "ckptfs.protocol.resolve",
    "CheckpointStore": "ckptfs.protocol.store",
    "open": "ckptfs.protocol.store",
    "TieredStore": "ckptfs.protocol.tiers",
    "tiered": "ckptfs.protocol.tiers",
    "Capabilities": "ckptfs.storage.base",
}


def __getattr__(name: str) -> Any:
    """Import a public name's module on first use and keep the name here."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ckptfs' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "FORMAT_VERSION",
    "ArtifactConflictError",
    "ArtifactMismatchError",
    "AsyncSaveError",
    "AsyncStats",
    "BackendUnavailableError",
    "Best",
    "Capabilities",
    "CheckpointDeletedError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointKeyError",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "CkptfsError",
    "CorruptCheckpointError",
    "ExportExistsError",
    "ExtensionTypeError",
    "FormatVersionError",
    "HashAlgorithmUnavailableError",
    "HfExport",
    "InvalidStepError",
    "InvalidURLError",
    "LoadOptionError",
    "Provenance",
    "ProvenanceMismatchError",
    "RemoteChecksumMismatchError",
    "ReplicationError",
    "ReplicationStatus",
    "RetentionPolicy",
    "RngStateError",
    "SaveFuture",
    "SaveOptionError",
    "SaveResult",
    "ShardedCheckpointError",
    "ShardedLoadError",
    "ShardedSaveError",
    "StagingBudgetError",
    "StepReplication",
    "StorageAccessError",
    "StorageError",
    "StorageNotFoundError",
    "TierMismatchError",
    "TierOverlapError",
    "TieredStore",
    "TrainerState",
    "UnreplicatedCheckpointError",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "VerifyReport",
    "__version__",
    "available_algorithms",
    "export_hf",
    "open",
    "register_type",
    "tiered",
]
