"""Typed errors of ckptfs.

Every error ckptfs raises derives from :class:`CkptfsError`; where an error refines a builtin
(a missing checkpoint is a ``FileNotFoundError``, an existing one a ``FileExistsError``, bad input
a ``ValueError`` or ``TypeError``) it inherits that builtin too, so ``except FileNotFoundError``
keeps working for callers that do not know ckptfs.  Messages say what is wrong, where (the URL or
path), and what to do next.  Exceptions from storage libraries (botocore, google-cloud, azure)
never escape raw: the storage adapter wraps them in :class:`StorageError` with the original as
``__cause__``.
"""

from __future__ import annotations


class CkptfsError(Exception):
    """Base class of every error raised by ckptfs."""


class InvalidStepError(CkptfsError, ValueError):
    """A step that is not a non-negative ``int`` (or is too large for the name format)."""


class UnsupportedValueError(CkptfsError, TypeError):
    """A value in the state that the format cannot store (names its key path)."""


class CheckpointNotFoundError(CkptfsError, FileNotFoundError):
    """The requested checkpoint does not exist or is not committed."""


class CheckpointExistsError(CkptfsError, FileExistsError):
    """A committed checkpoint already exists for the step (possibly just committed by a
    concurrent writer)."""


class CorruptCheckpointError(CkptfsError, ValueError):
    """A committed checkpoint whose files do not match its manifest (or whose manifest does not
    match its marker).  Never silently skipped."""

    def __init__(self, message: str, *, step: int | None = None, path: str | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.path = path


class UnsafeCheckpointError(CorruptCheckpointError):
    """A checkpoint whose metadata is hostile: paths escaping the checkpoint, symlinks, sizes or
    nesting beyond the format's bounds, unknown encodings."""


class FormatVersionError(CorruptCheckpointError):
    """The checkpoint was written by a newer, incompatible format version."""


class StorageError(CkptfsError, OSError):
    """A storage operation failed (network, permissions, missing bucket...).  ``__cause__`` holds
    the storage library's exception."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """A file, bucket or container that does not exist."""


class StorageAccessError(StorageError, PermissionError):
    """The storage refused the credentials or the operation."""


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
