"""Local-disk primitives of the local storage (`ckptfs.storage.fsspec`): reads that never wait
on something that is not a regular file, and the exclusive create's final link.

A run root on local disk is a directory anyone with access can change: a FIFO put in place of a
checkpoint's marker, manifest or a format v5 document (files read before any listing) would make
an ordinary ``open`` + ``read`` wait for a writer forever.  The local storage reads through
`open_regular`: the open never waits (``O_NONBLOCK``), and anything but a regular file is a typed
error naming it, before a byte is read.
"""

from __future__ import annotations

import errno
import os
import stat

from ckptfs.errors import CorruptCheckpointError, UnsafeCheckpointError

__all__ = ["link_or_create", "open_regular", "read_at"]


def open_regular(local: str, where: str, path: str, *, follow: bool = True,
                 step: int | None = None) -> int:
    """The local file ``local`` (``where``: how errors name it; ``path``: its storage path;
    ``step``: the checkpoint's, if known) opened for reading, as a descriptor: a FIFO, a
    directory, a device or a socket is `UnsafeCheckpointError`, and so is a symbolic link
    without ``follow``; a path through something that is not a directory (a directory of the
    layout replaced by a file or a FIFO), `CorruptCheckpointError`; a missing file,
    ``FileNotFoundError`` as raised.  ``O_NONBLOCK`` is cleared once the file is known to be
    regular."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    flags = os.O_RDONLY | nonblock | getattr(os, "O_CLOEXEC", 0)
    if not follow:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(local, flags)
    except NotADirectoryError:
        raise CorruptCheckpointError(f"read {where}: a directory on its path is not a directory "
                                     "(a file or a FIFO in its place)", step=step,
                                     path=path) from None
    except OSError as exc:
        if exc.errno != errno.ELOOP or follow:
            raise
        raise UnsafeCheckpointError(f"read {where} is not a regular file (a symbolic link); a "
                                    "checkpoint holds only regular files. Refusing to read it",
                                    step=step, path=path) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) \
                else "a device or a socket"
            raise UnsafeCheckpointError(f"read {where} is not a regular file ({kind}); a "
                                        "checkpoint holds only regular files. Refusing to read "
                                        "it", step=step, path=path)
        if nonblock:
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_at(fd: int, start: int, length: int) -> bytes:
    """Up to ``length`` bytes of ``fd`` at ``start`` (fewer only where the file ends)."""
    out = bytearray()
    while len(out) < length:
        got = os.pread(fd, length - len(out), start + len(out))
        if not got:
            break
        out += got
    return bytes(out)


def link_or_create(tmp: str, full: str, data: bytes) -> None:
    """Give the written and fsynced temporary file ``tmp`` (holding ``data``) the name ``full``
    exclusively: ``link`` (atomic; ``FileExistsError`` if ``full`` exists).  On a filesystem
    without hard links, ``O_EXCL`` and ``data`` written again (a crash mid-write can leave a
    partial file there, which a reader reports as corrupt, never as committed)."""
    try:
        os.link(tmp, full)
    except OSError as exc:
        if exc.errno == errno.EEXIST:
            raise FileExistsError(errno.EEXIST, "exists", full) from None
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
