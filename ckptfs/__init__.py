"""ckptfs: crash-consistent PyTorch training checkpoints on any fsspec storage.

>>> import ckptfs
>>> store = ckptfs.open("file:///data/runs/exp1")        # or memory://, s3://, gs://, az://
>>> info = store.save(1000, {"model": model.state_dict(), "trainer": {"step": 1000}})
>>> state = store.load()                                # newest committed, verified as read

The on-storage format is specified in docs/protocol.md.
"""

from .errors import (
    ArtifactConflictError,
    ArtifactMismatchError,
    BackendUnavailableError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CkptfsError,
    CorruptCheckpointError,
    FormatVersionError,
    HashAlgorithmUnavailableError,
    InvalidStepError,
    ProvenanceMismatchError,
    RngStateError,
    StorageAccessError,
    StorageError,
    StorageNotFoundError,
    UnsafeCheckpointError,
    UnsupportedValueError,
)
from .hashing import ALGORITHMS, DEFAULT_ALGORITHM, available_algorithms
from .layout import FORMAT_VERSION
from .manager import CheckpointManager, SaveResult, TrainerState
from .provenance import Provenance
from .reader import VerifyReport
from .resolve import CheckpointInfo
from .retention import Best, RetentionPolicy
from .storage.base import Capabilities
from .store import CheckpointStore, open

__version__ = "0.1.0"

__all__ = [
    "ALGORITHMS",
    "DEFAULT_ALGORITHM",
    "FORMAT_VERSION",
    "ArtifactConflictError",
    "ArtifactMismatchError",
    "BackendUnavailableError",
    "Best",
    "Capabilities",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointNotFoundError",
    "CheckpointStore",
    "CkptfsError",
    "CorruptCheckpointError",
    "FormatVersionError",
    "HashAlgorithmUnavailableError",
    "InvalidStepError",
    "Provenance",
    "ProvenanceMismatchError",
    "RetentionPolicy",
    "RngStateError",
    "SaveResult",
    "StorageAccessError",
    "StorageError",
    "StorageNotFoundError",
    "TrainerState",
    "UnsafeCheckpointError",
    "UnsupportedValueError",
    "VerifyReport",
    "__version__",
    "available_algorithms",
    "open",
]
