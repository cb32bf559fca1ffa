"""ckptfs: crash-consistent PyTorch training checkpoints on any fsspec storage.

>>> import ckptfs
>>> store = ckptfs.open("file:///data/runs/exp1")        # or memory://, s3://, gs://, az://
>>> info = store.save(1000, {"model": model.state_dict(), "trainer": {"step": 1000}})
>>> state = store.load()                                # newest committed, verified as read

The on-storage format is specified in docs/protocol.md.
"""

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
    LoadOptionError,
    ProvenanceMismatchError,
    RemoteChecksumMismatchError,
    ReplicationError,
    RngStateError,
    ShardedCheckpointError,
    ShardedLoadError,
    ShardedSaveError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
    TierMismatchError,
    TierOverlapError,
    UnreplicatedCheckpointError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
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
    "LoadOptionError",
    "Provenance",
    "ProvenanceMismatchError",
    "RemoteChecksumMismatchError",
    "ReplicationError",
    "ReplicationStatus",
    "RetentionPolicy",
    "RngStateError",
    "SaveFuture",
    "SaveResult",
    "ShardedCheckpointError",
    "ShardedLoadError",
    "ShardedSaveError",
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
