"""The room the disk tier's filesystem has: what a budget may take, and why a write failed.

LMDB's data file grows page by page as entries land, and pages freed by deletes are reused,
but a file never gives its pages back, and copy-on-write with readers open may hold a write's
old pages a while: a file may reach well past the bytes live in it. A budget that the
filesystem can not hold never evicts: once the disk is full every new write fails instead of
evicting the oldest entries. ``fitted`` cuts a budget past ``FIT`` of the room there is when
the tier opens (the free bytes plus the data file's own) to that, and says so (whether the
filesystem would hold the budget given at all). ``make_folder`` makes the tier's folder,
naming a file or a link to nothing where it belongs (``mkdir`` said only "File exists");
``make_private`` keeps the tier's folder and files to kdn's user, and refuses them where
another user owns them."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

from kdn.errors import TierUnavailable

log = logging.getLogger(__name__)

FIT = 0.75
"""Share of the filesystem's room a disk tier's budget may take (module docstring)."""
MIN_BUDGET = 1 << 20


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still add to ``path``'s filesystem (None: unknown)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def fitted(path: Path, budget: int) -> tuple[int, str]:
    """(the budget a disk tier at ``path`` takes, the warning where it is less than
    ``budget``, else "")."""
    free = free_bytes(path)
    if free is None:
        return budget, ""
    try:
        held = os.stat(path / "data.mdb").st_size
    except OSError:
        held = 0
    fit = max(MIN_BUDGET, int((free + held) * FIT))
    if budget <= fit:
        return budget, ""
    what = "more than its filesystem holds" if budget > free + held else \
        f"more than {FIT:.0%} of the room its filesystem has"
    return fit, (f"disk tier {path}: disk_bytes ({budget} bytes) is {what} ({free} bytes "
                 f"free, {held} in its data file); its budget is {fit} bytes ({FIT:.0%} of "
                 f"that room: the data file grows past the entries in it), so the oldest "
                 f"entries are evicted before the disk fills")


def describe(path: Path, need: int) -> str:
    """The free bytes of ``path``'s filesystem, in words, "the disk is full" where they are
    fewer than a write of ``need`` bytes takes (with 1 MiB for LMDB's pages): a full disk
    reaches LMDB's caller as ``mdb_txn_commit: Input/output error``."""
    free = free_bytes(path)
    if free is None:
        return f"the free space of {path}'s filesystem is not known"
    full = "the disk is full: " if is_full(path, need, free) else ""
    return f"{full}{free} bytes free on the filesystem of {path}"


def is_full(path: Path, need: int, free: int | None = None) -> bool:
    """Whether ``path``'s filesystem (``free`` bytes free, asked where None) lacks room for a
    write of ``need`` bytes with 1 MiB for LMDB's pages (False where its room is unknown)."""
    free = free_bytes(path) if free is None else free
    return free is not None and free < need + (1 << 20)


def make_folder(path: Path) -> None:
    """Make the disk tier's folder ``path`` and its parents where missing (kdn's user's only);
    ``TierUnavailable`` naming what stands where one of them belongs."""
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except FileExistsError as exc:
        where = exc.filename or str(path)
        what = "a link to nothing" if not os.path.exists(where) else "not a folder"
        raise TierUnavailable(f"disk tier: {where} is {what}; move it aside, or give kdn "
                              "serve another --data-dir") from None


def make_private(path: Path, files: Iterable[str] = ()) -> None:
    """Keep ``path`` (the disk tier's folder) and the ``files`` in it that are there to kdn's
    user: every tenant's KV is in them, and a tenant reads only its own through the server.
    The folder, then each file, must be kdn's user's (one another user made first stays
    readable by it, whatever its mode) and each file a regular file, not a link (a link
    planted there leads LMDB or the lock anywhere): else ``TierUnavailable`` naming the path
    and its owner. Group and others' access is taken away, the folder's first (then no other
    user adds a file to it)."""
    _checked(path, os.stat(path), folder=True)
    _take_access(path)
    for name in files:
        try:
            st = os.lstat(path / name)
        except FileNotFoundError:
            continue
        _checked(path / name, st, folder=False)
        _take_access(path / name)


def _checked(path: Path, st: os.stat_result, *, folder: bool) -> None:
    kind = stat.S_ISDIR if folder else stat.S_ISREG
    if not kind(st.st_mode):
        raise TierUnavailable(f"disk tier: {path} is not a {'folder' if folder else 'file'} "
                              f"(mode {st.st_mode:o}); move it aside")
    if st.st_uid != os.geteuid():
        raise TierUnavailable(f"disk tier: {path} is owned by uid {st.st_uid}, not by kdn's "
                              f"user (uid {os.geteuid()}): that user could read every "
                              "tenant's entries; move it aside, or give kdn serve a "
                              "--data-dir of its own")


def _take_access(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & 0o077:
        try:
            path.chmod(mode & 0o700)
        except OSError as exc:  # (a read-only filesystem): said, and left as it is
            log.warning("%s is open to other users (mode %o) and can not be made private: "
                        "%s", path, mode & 0o777, exc)
            return
        log.warning("%s was open to other users (mode %o); made private to kdn's user", path,
                    mode & 0o777)
