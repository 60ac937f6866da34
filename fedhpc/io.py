"""Atomic file writes: a reader never sees half a file, a crash never destroys the old one."""

from __future__ import annotations

import errno
import io
import json
import os
import tempfile
from typing import Any, Callable

import torch

from .errors import OutputError


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: mode of the files written here: what open() would give (mkstemp's 0600 would hide a run's
#: results from the colleagues a cluster group shares them with)
_FILE_MODE = 0o666 & ~_umask()

#: errors of the disk rather than of the program: reported as OutputError, naming the path
_DISK_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}


def _atomic(path: str, write: Callable[[Any], None], mode: str = "wb") -> None:
    directory = os.path.dirname(os.path.abspath(path))
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-" + os.path.basename(path))
        os.fchmod(fd, _FILE_MODE)
        with os.fdopen(fd, mode) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_directory(directory)
    except BaseException as e:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise_disk_error(path, e)
        raise


def raise_disk_error(path: str, e: BaseException) -> None:
    """Raise ``e`` as an OutputError naming ``path`` and the fix when it is an error of the disk
    (full, read-only, no permission, I/O error); return for any other, for the caller to re-raise."""
    if isinstance(e, OSError) and e.errno in _DISK_ERRNOS:
        raise OutputError(f"cannot write {path}: {e.strerror}; free space or fix the permissions "
                          f"there, or choose another --out (files already written, such as the last "
                          f"checkpoint, are intact)") from e


def write_synced(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` and sync it, for a file inside a directory that is made visible
    by a later rename (a checkpoint's ``.partial``): no temporary name of its own is needed, but
    its blocks must be on disk before that rename names them."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise_disk_error(path, e)
        raise


def fsync_directory(directory: str) -> None:
    """Make the renames done in ``directory`` durable: ``os.replace`` only changes the directory
    entry, which sits in the page cache until the directory itself is synced, so a node that
    loses power right after a checkpoint could come back with the old LATEST (or no file).
    File systems that cannot sync a directory (some network mounts answer EINVAL) are let be:
    there the rename is as durable as that file system makes it."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EBADF, errno.EACCES):
            raise
    finally:
        os.close(fd)


def durable_replace(src: str, dst: str) -> None:
    """``os.replace(src, dst)`` for a file written by a library that does not sync (h5py): its
    data is synced first, so the name never points at blocks still unwritten, then the rename."""
    fd = os.open(src, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(src, dst)
    fsync_directory(os.path.dirname(os.path.abspath(dst)))


def probe_write(directory: str) -> None:
    """Raise OSError unless a file can be created in ``directory``: checked before long work by
    whatever writes there later. A probe file, because permissions alone do not tell (os.access
    says yes to root on a read-only mount)."""
    fd, probe = tempfile.mkstemp(dir=directory, prefix=".fedhpc-write-test-")
    os.close(fd)
    os.unlink(probe)


def atomic_write_bytes(path: str, write: Callable[[Any], None]) -> None:
    """Write a binary file atomically through ``write(file_object)`` (plots, archives...)."""
    _atomic(path, write)


def atomic_torch_save(obj: Any, path: str) -> None:
    # Serialised in memory first: torch.save's own writer reports a full disk as "unexpected
    # pos", while a plain write raises the OSError (ENOSPC) that names the problem.
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    _atomic(path, lambda f: f.write(buffer.getbuffer()))


def atomic_write_text(path: str, text: str) -> None:
    _atomic(path, lambda f: f.write(text), mode="w")


def atomic_write_json(path: str, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")
