"""The disk tier's LMDB files at open, and what LMDB's failures mean to the tier.

Lock file: LMDB keeps its reader table in ``lock.mdb``, a file it maps and writes through the
map, and makes it by extending it with ``ftruncate``: a sparse file, only its first page
allocated. Each read transaction takes a slot in it; on a full filesystem the first read whose
slot lies on a page never allocated makes the kernel find no block for it, a SIGBUS that
kills the process without a word (at ``lmdb.open`` itself when the disk is full at start).
``reserve_lock`` allocates the whole file before LMDB opens it, so a full disk is an error
naming it (``DiskFull``) at open, and never a crash later.

Data file: the tier opens LMDB without ``writemap``, so LMDB writes ``data.mdb`` with
``pwrite`` (a full disk is an error of that write: ``LmdbTier``'s ``PartlyUnavailable``) and
maps it read-only, reading only pages it wrote; a file cut short under it is
``LmdbTier._truncated``'s case. ``file_id`` tells whether the file at its path is still the one
opened (the folder moved or deleted, the file replaced: ``LmdbTier._check_file``).
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb

from kdn.errors import DiskFull, PartlyUnavailable, TierUnavailable
from kdn.store.diskroom import describe, is_full

MAX_READERS = 512
"""Read transactions open at once; one more fails that read (``read_failed``)."""
_SLOT = 64  # LMDB's MDB_reader: one cache line
_HEAD = 512  # LMDB's MDB_txninfo less one slot, 128 to 256 bytes by platform: with room
_NO_ROOM = (errno.ENOSPC, errno.EDQUOT)

DAMAGED = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError,
           lmdb.VersionMismatchError)
"""What LMDB raises opening a data file that is not (or no longer) one it wrote."""


def file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at ``path`` now; None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def lock_bytes(max_readers: int) -> int:
    """Bytes of ``lock.mdb`` that cover the reader table of ``max_readers`` slots (LMDB maps
    as much of the file as it finds, so more is covered too), whole pages."""
    page = os.sysconf("SC_PAGE_SIZE")
    return -(-(max_readers * _SLOT + _HEAD) // page) * page


def reserve_lock(path: Path, max_readers: int) -> None:
    """Allocate every block of the LMDB environment ``path``'s lock file (made if missing)
    for ``max_readers`` readers; ``DiskFull`` where its filesystem has no room for them."""
    lock = path / "lock.mdb"
    size = lock_bytes(max_readers)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        size = max(size, os.fstat(fd).st_size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise DiskFull(f"can not open LMDB at {path}: its lock file {lock} needs {size} "
                           f"bytes, and {describe(path, size)}") from None
        raise OSError(exc.errno, exc.strerror, str(lock)) from None
    finally:
        os.close(fd)


def open_failed(path: Path, exc: lmdb.Error) -> TierUnavailable | OSError:
    """What an ``lmdb.Error`` opening the environment ``path`` raises: a damaged data file, a
    data file kdn's user may not write (immutable, another's: an ``OSError`` naming it, as
    ``reserve_lock``'s for the lock file), a disk too full to write LMDB's first pages
    (``DiskFull``), or LMDB's own words."""
    if isinstance(exc, DAMAGED):  # (zeroed, overwritten, another program's file)
        return TierUnavailable(f"can not open LMDB at {path}: its data file is damaged ({exc}); "
                               "move the folder aside to start with an empty disk tier")
    try:  # (LMDB's error names the folder and no errno)
        os.close(os.open(path / "data.mdb", os.O_RDWR | os.O_CLOEXEC))
    except FileNotFoundError:
        pass
    except OSError as err:
        return OSError(err.errno, err.strerror, str(path / "data.mdb"))
    if is_full(path, 0):
        return DiskFull(f"can not open LMDB at {path}: {describe(path, 0)} ({exc})")
    return TierUnavailable(f"can not open LMDB at {path}: {exc}")


def read_failed(exc: lmdb.Error) -> TierUnavailable:
    """What a read LMDB failed raises: a reader table full (more reads at once than
    ``max_readers``) fails that read only (``PartlyUnavailable``); anything else (an I/O error,
    a damaged file) takes the tier down until its probe reads again (``TierUnavailable``)."""
    if isinstance(exc, lmdb.ReadersFullError):
        return PartlyUnavailable(f"disk tier read refused: {exc}")
    return TierUnavailable(f"disk tier read failed: {exc}")
