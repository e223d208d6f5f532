"""The disk tier's map under concurrent writers: it grows once per need (a writer that finds the
map full does not grow it again when another writer already has), it refuses only data that
truly does not fit, and a refusal names what is stored. And a full disk: writes fail, reads go
on. Real LMDB files under ``tmp_path``."""

from __future__ import annotations

import logging
import os
import re
import resource
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from kdn.errors import TierUnavailable, TooLarge
from kdn.options import Durability
from kdn.store.dirlock import DirLock
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import TieredStore, WritePolicy

WRITERS = 16
DISK_BYTES = 32 << 20
VALUE = 64 << 10


class Events:
    """Collects what a tier reports through its ``on_event`` hook."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str, n: int) -> None:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + n


def _fill(tier: LmdbTier, upto: int) -> tuple[list[int], list[TooLarge]]:
    """``WRITERS`` threads put distinct ``VALUE``-byte entries, all starting at once, until the
    tier holds ``upto`` bytes. Returns the bytes stored at each refusal, and the refusals."""
    start = threading.Barrier(WRITERS)
    refused_at: list[int] = []
    refusals: list[TooLarge] = []
    lock = threading.Lock()

    def writer(w: int) -> None:
        value = os.urandom(VALUE)
        start.wait()
        i = 0
        while tier.stats().bytes < upto:
            try:
                tier.put(b"w%02d/%06d" % (w, i), value)
            except TooLarge as exc:
                with lock:
                    refused_at.append(tier.stats().bytes)
                    refusals.append(exc)
                return
            i += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(WRITERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return refused_at, refusals


def test_concurrent_writers_fill_the_disk_tier_without_refusals(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = LmdbTier(tmp_path, capacity_bytes=DISK_BYTES, initial_map_bytes=1 << 20, sync=False)
    events = Events()
    tier.on_event = events
    try:
        with caplog.at_level(logging.INFO, logger="kdn.store.lmdb"):
            refused_at, refusals = _fill(tier, DISK_BYTES * 9 // 10)
        assert refused_at == [], [str(e) for e in refusals]
        assert tier.stats().bytes >= DISK_BYTES * 9 // 10
        # Each growth at least doubles the map from 1 MiB: a handful suffice for 32 MiB of
        # entries, never one per writer that found the map full.
        grown = events.counts.get("map_grown", 0)
        assert 1 <= grown <= 7, events.counts
        assert "map_full" not in events.counts
        growths = [r for r in caplog.records
                   if r.name == "kdn.store.lmdb" and "map grown" in r.getMessage()]
        assert len(growths) == grown and all(r.levelno == logging.INFO for r in growths)
        assert tier.map_size <= tier.max_map_bytes
    finally:
        tier.close()


def test_refusal_past_the_map_ceiling_names_the_real_usage(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A map ceiling (8 MiB) far below the byte budget (32 MiB): the data truly does not fit.
    tier = LmdbTier(tmp_path, capacity_bytes=DISK_BYTES, initial_map_bytes=1 << 20,
                    max_map_bytes=8 << 20, sync=False)
    events = Events()
    tier.on_event = events
    try:
        with caplog.at_level(logging.INFO, logger="kdn.store.lmdb"):
            refused_at, refusals = _fill(tier, DISK_BYTES)
        assert refusals, "an 8 MiB map can not hold 32 MiB"
        # Refused only once the map was (near) full, never while most of it was free.
        assert min(refused_at) >= (8 << 20) // 2
        used = tier.stats().bytes
        for exc in refusals:
            msg = str(exc)
            m = re.search(r"(\d+) bytes stored of a (\d+)-byte budget", msg)
            assert m is not None and "8388608-byte maximum" in msg, msg
            assert 0 < int(m[1]) <= used and int(m[2]) == DISK_BYTES
        assert events.counts.get("map_full") == len(refusals)
        warnings = [r for r in caplog.records
                    if r.name == "kdn.store.lmdb" and r.levelno == logging.WARNING]
        assert len(warnings) == len(refusals)
        assert tier.map_size == 8 << 20
    finally:
        tier.close()


def test_hierarchy_counts_the_disk_tier_events(tmp_path: Path) -> None:
    disk = LmdbTier(tmp_path, capacity_bytes=DISK_BYTES, initial_map_bytes=1 << 20, sync=False)
    store = TieredStore([RamTier(1 << 20), disk], write_policy=WritePolicy.WRITE_BEHIND)
    try:
        for i in range(64):
            disk.put(b"h/%d" % i, os.urandom(VALUE))
        assert store.counters.get("disk.map_grown", 0) >= 1
    finally:
        store.close()


@contextmanager
def _disk_full(data_file: Path) -> Iterator[None]:
    """Within the block, this process's writes past ``data_file``'s size now fail (EFBIG, as
    ENOSPC would on a full disk): RLIMIT_FSIZE, with SIGXFSZ ignored."""
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(data_file) + 4096, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_full_disk_fails_writes_but_keeps_serving_reads(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The disk full: a DISK store fails (UNAVAILABLE) and leaves nothing, a DEFAULT store is
    acknowledged (RAM) and its disk write retried until there is room again (the queue's
    warning names why the disk did not take it); meanwhile the entries on disk are served and
    the tier is never marked down (no flapping with the probe)."""
    ram = RamTier(1 << 20)
    disk = LmdbTier(tmp_path, capacity_bytes=1 << 30, initial_map_bytes=64 << 20)
    store = TieredStore([ram, disk], probe_interval_s=0.05)
    try:
        for i in range(3):
            store.put(b"old%d" % i, bytes([i]) * 100_000)
        with _disk_full(tmp_path / "data.mdb"):
            with pytest.raises(TierUnavailable, match="disk tier write failed"):
                store.put(b"new", b"n" * 300_000, durability=Durability.DISK)
            with caplog.at_level(logging.WARNING, logger="kdn.store.queue"):
                assert store.put(b"new2", b"m" * 300_000) == "ram"
            assert any("disk tier write failed" in r.getMessage() for r in caplog.records
                       if r.name == "kdn.store.queue"), caplog.text
            ram.delete(b"old1")
            hit = store.get(b"old1")
            assert hit is not None and hit.tier == "disk" and hit.value == bytes([1]) * 100_000
            time.sleep(0.3)  # a few probes
            assert store.health()["disk"] and "disk.down" not in store.counters
        assert store.flush(5) and disk.get(b"new2") == b"m" * 300_000
        assert not disk.contains(b"new")
    finally:
        store.close()


def test_a_budget_its_filesystem_can_not_hold_is_cut_to_fit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
        ) -> None:
    """A 16 GiB budget (the default) over a filesystem with 40 MiB free: the tier takes 75% of
    the room (free bytes plus its data file), says so, and evicts its oldest entries at that
    budget instead of filling the disk; a budget the filesystem holds is kept as given."""
    from kdn.store import diskroom

    monkeypatch.setattr(diskroom, "free_bytes", lambda path: 40 << 20)
    with caplog.at_level(logging.WARNING, logger="kdn.store.lmdb"):
        tier = LmdbTier(tmp_path / "a", capacity_bytes=16 << 30)
    try:
        assert tier.capacity_bytes == int((40 << 20) * 0.75)  # a new tier: no data file yet
        assert "disk_bytes (17179869184 bytes) is more than its filesystem holds" in caplog.text
        for i in range(40):  # 40 MiB: past the cut budget, evicting, never past it
            tier.put(b"k%03d" % i, bytes(1 << 20))
        assert tier.stats().bytes <= tier.capacity_bytes and tier.get(b"k039") is not None
    finally:
        tier.close()
    held = (tmp_path / "a" / "data.mdb").stat().st_size
    again = LmdbTier(tmp_path / "a", capacity_bytes=16 << 30)  # its file's pages count as room
    assert again.capacity_bytes == int(((40 << 20) + held) * 0.75) > tier.capacity_bytes
    again.close()
    kept = LmdbTier(tmp_path / "b", capacity_bytes=8 << 20)
    assert kept.capacity_bytes == 8 << 20
    kept.close()


@pytest.mark.parametrize("disk_bytes", [None, 8 << 30], ids=["default", "set"])
def test_the_default_budget_is_cut_quietly_and_a_set_one_with_a_warning(
        disk_bytes: int | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A server's default 16 GiB budget on a disk with less room is cut without a warning:
    nobody asked for it, and every start of ``kdn serve`` printed one above its ready line
    (CI's disk once had 22 GB free; the ready line now shows the budget taken). A budget one
    set is cut with the warning. Both are cut to the same room; the default's cut is logged at
    DEBUG."""
    from kdn.server import ServerConfig, build_store
    from kdn.store import diskroom

    monkeypatch.setattr(diskroom, "free_bytes", lambda path: 40 << 20)
    given = {} if disk_bytes is None else {"disk_bytes": disk_bytes}
    with caplog.at_level(logging.DEBUG, logger="kdn.store.lmdb"):
        store = build_store(ServerConfig(data_dir=tmp_path / "data", **given))
    try:
        (tier,) = [t for t in store.tiers if isinstance(t, LmdbTier)]
        assert tier.capacity_bytes == int((40 << 20) * 0.75)
        cut = [r for r in caplog.records if "is more than its filesystem holds" in r.getMessage()]
        assert len(cut) == 1, caplog.text
        assert cut[0].levelno == (logging.DEBUG if disk_bytes is None else logging.WARNING)
    finally:
        store.close()


def test_the_disk_tier_is_private_to_the_servers_user(tmp_path: Path) -> None:
    """Every tenant's KV is in the disk tier's files, and a tenant reads only its own through
    the server: the folder is its user's alone (0700), the files too (0600), also a folder an
    older kdn left open to others."""
    older = tmp_path / "older"
    older.mkdir(mode=0o755)
    older.chmod(0o755)
    (older / "data.mdb").touch(mode=0o644)
    for path in (tmp_path / "new", older):
        tier = LmdbTier(path, capacity_bytes=1 << 20)
        try:
            tier.put(b"k", b"v" * 100)
            assert path.stat().st_mode & 0o777 == 0o700
            for name in ("data.mdb", "lock.mdb", "kdn.lock"):
                assert (path / name).stat().st_mode & 0o777 == 0o600, name
        finally:
            tier.close()


def test_a_restart_finds_its_lock_file_private(tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    """kdn.lock is made 0600: a second start has nothing to make private and warns nothing
    (it was made 0644 after make_private ran, so every restart warned 'was open to other users'
    and a refused second opener chmodded the running holder's lock file)."""
    LmdbTier(tmp_path / "d", capacity_bytes=1 << 20).close()
    with caplog.at_level(logging.WARNING):
        LmdbTier(tmp_path / "d", capacity_bytes=1 << 20).close()
    assert not [r.getMessage() for r in caplog.records if "private" in r.getMessage()]


def test_a_disk_tier_another_user_made_first_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder or file another user made there first (``kdn serve`` started in a shared
    folder) would stay readable by that user whatever mode kdn gives it, and a link planted
    for a file kdn opens (``kdn.lock`` is cut and written) leads anywhere: refused, naming the
    path and its owner, before any is opened."""
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    me = os.geteuid()
    someone_else = me + 1
    with monkeypatch.context() as m:
        m.setattr("kdn.store.diskroom.os.geteuid", lambda: someone_else)
        with pytest.raises(TierUnavailable, match=f"{theirs} is owned by uid {me}, "
                                                  f"not by kdn's user \\(uid {someone_else}"):
            LmdbTier(theirs, capacity_bytes=1 << 20)
    precious = tmp_path / "precious.conf"
    precious.write_text("precious\n")
    for name in ("kdn.lock", "lock.mdb", "data.mdb"):
        planted = tmp_path / name.replace(".", "-")
        planted.mkdir()
        (planted / name).symlink_to(precious)
        with pytest.raises(TierUnavailable, match=f"{planted / name} is not a file"):
            LmdbTier(planted, capacity_bytes=1 << 20)
    with pytest.raises(OSError):  # and the lock, alone, opens no link either
        DirLock(tmp_path / "kdn-lock")
    assert precious.read_text() == "precious\n"
    if os.geteuid() == 0:  # a file of another user's in kdn's own folder
        mixed = tmp_path / "mixed"
        mixed.mkdir()
        (mixed / "data.mdb").touch()
        os.chown(mixed / "data.mdb", 65534, 65534)
        with pytest.raises(TierUnavailable, match="data.mdb is owned by uid 65534"):
            LmdbTier(mixed, capacity_bytes=1 << 20)


def test_a_smaller_budget_at_restart_evicts_the_oldest_and_takes_writes(tmp_path: Path) -> None:
    """Reopened with a budget smaller than the data there (and its map ceiling below the data
    file), the tier evicts its oldest entries down to the budget at once and writes go on (all
    were refused, map full, for good)."""
    tier = LmdbTier(tmp_path / "l", capacity_bytes=64 << 20, initial_map_bytes=1 << 20)
    for i in range(80):
        tier.put(b"k/%03d" % i, os.urandom(VALUE * 8))
    tier.close()
    small = LmdbTier(tmp_path / "l", capacity_bytes=4 << 20, initial_map_bytes=1 << 20)
    try:
        assert small.stats().bytes <= 4 << 20
        assert not small.contains(b"k/000") and small.contains(b"k/079")
        for i in range(40):
            small.put(b"n/%03d" % i, os.urandom(VALUE * 4))
        assert small.contains(b"n/039") and small.stats().bytes <= 4 << 20
    finally:
        small.close()


def test_a_budget_the_filesystem_holds_past_the_headroom_is_cut_as_such(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget between 75% and all of the room (deploy/kdn.example.yaml's 64 GiB on a disk
    with 68 GiB free) is cut to 75%, and the warning says it is more than 75% of the room, not
    (as it did) more than the filesystem holds."""
    from kdn.store import diskroom

    monkeypatch.setattr(diskroom, "free_bytes", lambda path: 40 << 20)
    budget, warning = diskroom.fitted(tmp_path, 36 << 20)
    assert budget == int((40 << 20) * 0.75)
    assert "is more than 75% of the room its filesystem has" in warning, warning
    assert "more than its filesystem holds" not in warning
