"""Typed errors of ckptfs.

Every error ckptfs raises derives from `CkptfsError`; where an error refines a builtin
(a missing checkpoint is a ``FileNotFoundError``, an existing one a ``FileExistsError``, bad input
a ``ValueError`` or ``TypeError``) it inherits that builtin too, so ``except FileNotFoundError``
keeps working for callers that do not know ckptfs.  Messages say what is wrong, where (the URL or
path), and what to do next.  Exceptions from storage libraries (botocore, google-cloud, azure)
never escape raw: the storage adapter wraps them in `StorageError` with the original as
``__cause__``.
"""

from __future__ import annotations


class CkptfsError(Exception):
    """Base class of every error raised by ckptfs."""


class InvalidStepError(CkptfsError, ValueError):
    """A step that is not a non-negative ``int`` (or is too large for the name format)."""


class UnsupportedValueError(CkptfsError, TypeError):
    """A value in the state that the format cannot store (names its key path)."""


class ExtensionTypeError(CkptfsError, TypeError):
    """An extension type (docs/protocol.md, section 2.3.1) that cannot be registered or
    restored: a conflicting registration, a type name stored in a checkpoint that is not
    registered in this process (the message names the key path and how to register it), or a
    registered decode function that refused its stored value.  The checkpoint is not corrupt,
    so ``allow_rollback`` never skips it."""


class CheckpointKeyError(CkptfsError, KeyError):
    """``load(keys=...)`` named a key path the checkpoint does not hold (the message lists the
    keys available where the path stopped matching)."""

    def __str__(self) -> str:  # KeyError would show the message quoted, as a repr
        return str(self.args[0]) if self.args else ""


class LoadOptionError(CkptfsError, TypeError):
    """A ``load`` option of a type or value ckptfs does not accept (a ``map_location`` that is
    not a str, torch.device, dict or callable; ``mmap`` off local disk; malformed ``keys``)."""


class SaveOptionError(CkptfsError, ValueError):
    """A store's save option of a type or value ckptfs does not accept (``threads`` not a
    positive int, ``lease_s`` negative, ``durable`` not a bool); raised by ``ckptfs.open``
    and ``ckptfs.tiered`` before anything is written (`ckptfs.protocol.options`)."""


class CheckpointNotFoundError(CkptfsError, FileNotFoundError):
    """The requested checkpoint does not exist or is not committed."""


class CheckpointDeletedError(CheckpointNotFoundError):
    """A committed checkpoint was deleted (or replaced by another attempt) while it was being
    read: a prune or another job, not corruption.  Load again."""


class CheckpointExistsError(CkptfsError, FileExistsError):
    """A committed checkpoint already exists for the step (possibly just committed by a
    concurrent writer)."""


class ExportExistsError(CkptfsError, FileExistsError):
    """An export's output already exists: a directory holding an earlier Hugging Face export's
    files (``model*.safetensors``, ``model.safetensors.index.json``), or a file where a
    directory is wanted.  Pass ``force=True`` (``--force``) to replace the export, or choose
    another directory."""


class CorruptCheckpointError(CkptfsError, ValueError):
    """A committed checkpoint whose files do not match its manifest (or whose manifest does not
    match its marker).  Never silently skipped."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.path = path


class RemoteChecksumMismatchError(CorruptCheckpointError):
    """``verify(remote=True)``: the object store's own checksum of a file differs from the one
    the manifest recorded while writing (the stored bytes changed), or a file is missing or
    resized.  ``report`` is the per-file report (docs/remote-verify.md)."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None,
                 report: object = None) -> None:
        super().__init__(message, step=step, path=path)
        self.report = report


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint whose metadata is hostile: paths escaping the checkpoint, symlinks, sizes or
    nesting beyond the format's bounds, unknown encodings."""


class FormatVersionError(CorruptCheckpointError):
    """The checkpoint was written by a newer, incompatible format version."""


class TierMismatchError(CorruptCheckpointError):
    """A two-tier read whose preferred copy of a step fails (corrupt, unreadable) found in the
    other tier a copy of that step number that is not the same checkpoint (other content: another
    run's, or this run's before a restart from scratch), or one it cannot compare with the failing
    copy (that copy's manifest is unreadable).  It is not used in its place: the message names
    both copies.  ``allow_rollback=True`` skips the step (logged) for the next older one
    (docs/tiers.md, "Resume across tiers")."""


class StorageError(CkptfsError, OSError):
    """A storage operation failed (network, permissions, missing bucket...).  ``__cause__`` holds
    the storage library's exception."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """A file, bucket or container that does not exist."""


class StorageAccessError(StorageError, PermissionError):
    """The storage refused the credentials or the operation."""


class InvalidURLError(CkptfsError, ValueError):
    """A run root URL that fsspec would read as something else than what was almost surely
    meant: ``s3:/bucket/run`` or ``s3:bucket/run`` (one slash or none after the protocol) is a
    *local* relative path (``./s3:/bucket/run``), so a save would "succeed" on the node's disk.
    The message names the URL and the intended form (``s3://bucket/run``); a local directory
    whose name ends in ``:`` is written ``./s3:/...`` or as an absolute path."""


class BackendUnavailableError(CkptfsError, ImportError):
    """The URL's protocol is unknown, or the package that implements it is not installed."""


class HashAlgorithmUnavailableError(CkptfsError, ImportError):
    """The requested hash algorithm needs a package that is not installed."""


class RngStateError(CkptfsError, ValueError):
    """An RNG state that cannot be restored: malformed, or missing for this rank when the caller
    asked for an exact restore."""


class ArtifactConflictError(CkptfsError, FileExistsError):
    """A write-once run artifact already exists under this name with a different descriptor."""


class ArtifactMismatchError(CorruptCheckpointError):
    """A run artifact whose content or descriptor does not match what was recorded or asked."""


class ProvenanceMismatchError(CkptfsError, ValueError):
    """Resuming under a run config or provenance that differs from the checkpoint's.
    ``differences`` lists ``(key, expected, actual)`` for every differing key."""

    def __init__(self, message: str, *, differences: list[tuple[str, object, object]],
                 diagnostic: str | None = None) -> None:
        super().__init__(message)
        self.differences = differences
        self.diagnostic = diagnostic


class ShardedCheckpointError(CkptfsError, RuntimeError):
    """A collective (sharded) save or load failed on one or more ranks, or a checkpoint
    collective itself failed (a rank died or timed out).  Raised on every rank; ``failures``
    maps each failing rank to its error, as text."""

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        super().__init__(message)
        self.failures = dict(failures or {})


class ShardedSaveError(ShardedCheckpointError):
    """A sharded save failed: nothing was committed (no marker), the previous checkpoint stays
    the latest, and garbage collection removes the attempt's files."""


class ReplicaMismatchError(ShardedSaveError):
    """A tensor that several ranks hold, and that a collective save stores once, differs
    between them: nothing is written.  The message names the key and the ranks of each copy
    (``ckptfs.protocol.replicas``)."""


class ShardedLoadError(ShardedCheckpointError):
    """A sharded load failed on one or more ranks; the state passed as ``into`` may be
    partly filled."""


class AsyncSaveError(CkptfsError, RuntimeError):
    """An async-save call that cannot work where it was made (e.g. waiting for the store's
    pending saves from the background save thread itself, which would deadlock)."""


class StagingBudgetError(AsyncSaveError, ValueError):
    """``save_async(..., staging_bytes=...)``: something that must be staged at once does not
    fit the staging budget (a tensor larger than it; docs/async.md section 5).  ``key`` names
    the tensor (its key path), ``nbytes`` what it needs, ``budget`` the budget."""

    def __init__(self, message: str, *, key: str | None = None, nbytes: int = 0,
                 budget: int = 0) -> None:
        super().__init__(message)
        self.key = key
        self.nbytes = nbytes
        self.budget = budget


class ReplicationError(CkptfsError, RuntimeError):
    """Replication to the remote tier of a two-tier store cannot complete (docs/tiers.md): a
    step failed for good (the message says why), or the replicator stopped.  The local
    checkpoints are unaffected."""


class TierOverlapError(CkptfsError, ValueError):
    """The two tiers of a two-tier store are the same run root (however spelled: a symbolic
    link, ``..``, a trailing slash) or one lies inside the other.  Every step would count as
    replicated to itself and retention would delete its only copy; give the remote tier a run
    root of its own."""


class UnreplicatedCheckpointError(ReplicationError):
    """A delete of a local checkpoint that has not reached the remote tier yet, refused: it
    would be the only copy.  Wait for replication (``store.wait_replicated()``) or open the
    store with ``delete_unreplicated=True`` (docs/tiers.md, local retention)."""


class SaveDeadlineError(CkptfsError, TimeoutError):
    """A save (``store.save``, ``save_async``, a collective save, a copy or a replication) did
    not commit within its deadline (``ckptfs.open(url, save_deadline_s=...)``; docs/
    reliability.md "Bounded saves"): a storage request made no progress until the deadline
    ran out.  The message names the rank (where there are several), the file or object being
    written, how long that request had been stalled and how much of the file was written.
    Nothing was committed (no marker; the stalled upload was discarded, not completed), except
    where the stalled request was the marker itself (``outcome_unknown``: the step may still
    appear committed).  ``rank``, ``path``, ``stalled_s`` and ``deadline_s`` carry the facts
    on the rank that stalled (None on the others)."""

    def __init__(self, message: str, *, rank: int | None = None, path: str | None = None,
                 stalled_s: float | None = None, deadline_s: float | None = None,
                 outcome_unknown: bool = False) -> None:
        super().__init__(message)
        self.rank = rank
        self.path = path
        self.stalled_s = stalled_s
        self.deadline_s = deadline_s
        self.outcome_unknown = outcome_unknown

    def __str__(self) -> str:  # OSError would print its single argument as it is, but be safe
        return str(self.args[0]) if self.args else ""


class ShardedSaveDeadlineError(ShardedSaveError, SaveDeadlineError):
    """A collective save in which some rank(s) ran out of their save deadline
    (`SaveDeadlineError`): raised on every rank, naming the stalled rank(s) and their files;
    a `ShardedSaveError` (``failures``) and a `SaveDeadlineError` (a ``TimeoutError``)."""

    def __init__(self, message: str, *, failures: dict[int, str] | None = None) -> None:
        ShardedSaveError.__init__(self, message, failures=failures)
        self.rank = min(self.failures) if self.failures else None
        self.path = None
        self.stalled_s = None
        self.deadline_s = None
        self.outcome_unknown = False
