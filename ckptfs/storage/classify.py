"""What a storage library's exception means, as data: "exists" (a create-only write refused),
"not found", "access denied" (refused permissions, and credentials refused or missing), or a
*permanent* failure that must not be retried.

The HTTP statuses and service error codes of every backend are tables below, read from the
whole exception chain (the libraries wrap each other's exceptions).

Permanent failures:

A failure that waiting cannot fix (the disk is full, the path runs through a regular file, the
filesystem is read-only, a name is too long) must not be retried: the retry layer would spend
its back-off on it and then blame "the storage service and network", and on a full disk each
try of a local exclusive create used to leave a temporary file behind.  Such failures are
recognised by the ``errno`` of the operating-system error anywhere in the exception chain; the
table gives the advice the error message carries.

Only errno values whose meaning is the same for local disk and for the storage libraries
(which reuse errno codes for HTTP answers, e.g. s3fs maps ``IncompleteBody`` to ``EINVAL`` and
``InternalError`` to ``EREMOTEIO``) are listed: ``EINVAL``, ``EIO`` and ``EBUSY`` stay
retryable.  Permission errors (``EACCES``, ``EPERM``) and "not found"/"exists" are already
typed (`StorageAccessError`, `StorageNotFoundError`,
``FileExistsError``) and never retried either.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator, Mapping

from ckptfs.errors import StorageAccessError, StorageError, StorageNotFoundError

#: errno -> what the user can do about it.
PERMANENT_ERRNOS: Mapping[int, str] = {
    errno.ENOSPC: "no space left on the device: free space, or save elsewhere",
    errno.EDQUOT: "disk quota exceeded: free space or raise the quota",
    errno.EROFS: "the filesystem is read-only: remount it read-write, or save elsewhere",
    errno.ENOTDIR: "a path component is a regular file, not a directory: remove or rename it",
    errno.EISDIR: "a directory is where a file is expected: remove or rename it",
    errno.ENAMETOOLONG: "a name is too long for this storage: use a shorter run root",
    errno.ELOOP: "too many levels of symbolic links in the path",
    errno.EFBIG: "the file is larger than this filesystem allows",
    errno.EMSGSIZE: "the object is larger than this storage allows",
    errno.ENOTEMPTY: "the directory is not empty",
    errno.EXDEV: "the paths are on different filesystems",
    errno.EACCES: "permission denied: check the permissions of the run root",
    errno.EPERM: "operation not permitted: check the permissions of the run root",
}


def permanent_errno(exc: BaseException) -> int | None:
    """The errno of the first permanent OS error in ``exc``'s chain, or ``None``."""
    for cur in error_chain(exc):
        code = getattr(cur, "errno", None) if isinstance(cur, OSError) else None
        if isinstance(code, int) and code in PERMANENT_ERRNOS:
            return code
    return None


def permanent_advice(exc: BaseException) -> str | None:
    """What to do about a permanent failure (``None`` if ``exc`` is not one)."""
    code = permanent_errno(exc)
    return None if code is None else PERMANENT_ERRNOS[code]


def error_chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        yield cur
        cur = cur.__cause__ or cur.__context__


def status_code(exc: BaseException) -> tuple[int | None, str]:
    """The HTTP status and service error code an exception carries, whatever the library:
    botocore's ``response`` dict, azure-core's ``status_code``/``error_code``, gcsfs's
    ``HttpError.code``, aiohttp's ``status``."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        status = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        err = response.get("Error", {})
        code = err.get("Code", "") if isinstance(err, dict) else ""
        return (status if isinstance(status, int) else None), str(code or "")
    status = None
    for attr in ("status_code", "code", "status"):
        value = getattr(exc, attr, None)
        if isinstance(value, int) and not isinstance(value, bool) and 100 <= value < 600:
            status = value
            break
    code = getattr(exc, "error_code", None)
    code = getattr(code, "value", code)  # azure's StorageErrorCode enum
    return status, str(code or "")


def is_precondition_failure(exc: BaseException) -> bool:
    """A create-only write refused because the object exists, whatever class the library used:
    s3fs raises FileExistsError only when the 412 names ``If-None-Match``, else OSError(EINVAL)
    (ministack); gcsfs maps 412 to FileExistsError; adlfs raises FileExistsError from azure's
    ResourceExistsError (BlobAlreadyExists).  The exception chain is searched for an HTTP 412
    status or a precondition error code; anything else (a 400, a 403, a 5xx, a timeout) is not
    "exists", even when the library wraps it in the same OSError class."""
    for cur in error_chain(exc):
        if isinstance(cur, FileExistsError):
            return True
        status, code = status_code(cur)
        if status == 412 or code in _PRECONDITION_CODES:
            return True
        text = str(cur)
        if any(m in text for m in _PRECONDITION_TEXT):
            return True
    return False


_PRECONDITION_CODES = {"PreconditionFailed", "ConditionNotMet", "BlobAlreadyExists",
                       "conditionNotMet"}
_PRECONDITION_TEXT = ("PreconditionFailed", "Precondition Failed", "ConditionNotMet",
                      "pre-conditions you specified did not hold", "BlobAlreadyExists")
_NOT_FOUND_CODES = {"NoSuchBucket", "NoSuchKey", "NotFound", "ContainerNotFound", "BlobNotFound",
                    "ResourceNotFound", "NoSuchUpload"}
_ACCESS_CODES = {"AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "InvalidToken",
                 "ExpiredToken", "AllAccessDisabled", "AuthenticationFailed",
                 "AuthorizationFailure", "AuthorizationPermissionMismatch",
                 "InvalidAuthenticationInfo", "Forbidden"}


#: The storage libraries' exceptions (class names, matched along each exception's class
#: hierarchy) that mean the credentials are missing or refused before any request reached the
#: service: botocore finding no credentials (or half of them, or failing to fetch them from
#: SSO or a credential process), google-auth finding no default credentials or refusing a
#: token refresh, azure-identity finding no credential, azure-core's authentication failure.
#: Waiting cannot fix any of them: they are `StorageAccessError`, never retried, and raised at
#: open (docs/tiers.md).
_CREDENTIAL_ERRORS = frozenset({
    "NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
    "NoAuthTokenError", "UnauthorizedSSOTokenError", "SSOTokenLoadError",
    "TokenRetrievalError",                                  # botocore
    "DefaultCredentialsError", "RefreshError",              # google-auth
    "CredentialUnavailableError", "ClientAuthenticationError",  # azure-identity, azure-core
})


def is_credential_error(exc: BaseException) -> bool:
    """Whether ``exc`` is one of `_CREDENTIAL_ERRORS` (a google-auth refresh error that says
    it is retryable, e.g. a token endpoint's 503, is not)."""
    names = {c.__name__ for c in type(exc).__mro__}
    return bool(names & _CREDENTIAL_ERRORS) and not getattr(exc, "retryable", False)


def classify(exc: BaseException) -> type[StorageError]:
    """The ckptfs error class for a storage library's exception, from the whole chain: a missing
    bucket, container or object is `StorageNotFoundError`; missing or refused credentials
    (`is_credential_error`) or permissions `StorageAccessError`; anything else
    `StorageError`."""
    for cur in error_chain(exc):
        if isinstance(cur, StorageError):
            return type(cur)
        if isinstance(cur, FileNotFoundError):
            return StorageNotFoundError
        if isinstance(cur, PermissionError):
            return StorageAccessError
        status, code = status_code(cur)
        if status == 404 or code in _NOT_FOUND_CODES:
            return StorageNotFoundError
        if status in (401, 403) or code in _ACCESS_CODES:
            return StorageAccessError
        if is_credential_error(cur) or str(cur).startswith("Forbidden"):
            return StorageAccessError
    return StorageError


def _first_lines(exc: BaseException) -> str:
    """The message without the request ids, timestamps and XML bodies azure-core appends; a
    first line ending in ``:`` (botocore's ParamValidationError) keeps the line after it."""
    out: list[str] = []
    for line in str(exc).strip().splitlines():
        line = line.strip()
        if not line:
            continue
        if out and line.startswith(("RequestId:", "Time:", "ErrorCode:", "Content:", "<")):
            break
        out.append(line)
        if not line.endswith(":"):
            break
    return " ".join(out)


def describe_cause(exc: BaseException) -> str:
    """One line naming the library's exception and the service's reason (code, HTTP status)."""
    first = _first_lines(exc)
    text = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
    for cur in error_chain(exc):
        status, code = status_code(cur)
        if code or status:
            parts = [code] if code and code != str(status) else []
            parts += [f"HTTP {status}"] if status else []
            extra = ", ".join(parts)
            if extra and extra not in text:
                text += f" ({extra})"
            inner = _first_lines(cur)
            if cur is not exc and inner and inner not in text:
                text += f": {inner}"
            break
    return text if len(text) <= 400 else text[:397] + "..."
