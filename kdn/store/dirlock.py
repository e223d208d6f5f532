"""An exclusive lock on a folder for the life of its owner: one process at a time writes a
disk tier.

    lock = DirLock(path)   # refused at once with ``InUse``, naming the folder and the holder
    ...
    lock.release()         # at close (the kernel releases it too when the process ends)

Why: ``LmdbTier`` keeps per-process state beside its LMDB environment (the access stamps, the
map size it grew to), so two processes writing one environment do not share it safely: the
second's map growth makes the first's transactions fail with MDB_MAP_RESIZED, its disk tier
goes down, and the writes queued for it are dropped.

How: ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``<path>/kdn.lock`` (never a link to it; made 0600, as
the environment's files). A flock belongs to the open file, so a second opener in the same process
is refused as well (LMDB forbids opening one environment twice in a process). The holder writes its
pid into the file for the refusal's message (no room for it is ``DiskFull``, the lock let go); the
lock, not the file, decides: a file left by a process that died holds nothing. The file is never
removed (a removed lock file would let two processes lock two files).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from kdn.errors import DiskFull, InUse
from kdn.store.diskroom import describe

LOCK_NAME = "kdn.lock"


class DirLock:
    """The lock of ``path`` (a folder that exists), taken in the constructor."""

    def __init__(self, path: Path) -> None:
        self.path = path / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise InUse(f"{path} is in use by another process ({holder} holds its "
                        f"{LOCK_NAME})") from None
        except BaseException:
            os.close(fd)
            raise
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except OSError as exc:
            os.close(fd)  # (and its lock)
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskFull(f"can not write {self.path}: {describe(path, 0)}") from None
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None
        self._fd: int | None = fd

    def release(self) -> None:
        """Let the next owner in; idempotent."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing the file releases its flock


def _holder(fd: int) -> str:
    """'pid N' of the lock's holder as it wrote it; the holder may not have written it yet."""
    text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    return f"pid {text}" if text.isdigit() else "pid not yet written"
