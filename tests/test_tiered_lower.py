"""The hierarchy's lower tiers failing or refusing: a part of a tier that does not answer, a
tier that refuses writes and deletes for good, one that raises what no tier should, an LMDB
whose reads fail, a disk tier whose room is pinned. The policies themselves:
tests/test_tiered.py."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import lmdb
import pytest

from kdn.errors import KDNError, PartlyUnavailable, TooLarge
from kdn.store import queue
from kdn.store.framed import Framed
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.tiered import Durability, Hit, TieredStore, WritePolicy
from tests import test_tiered
from tests.helpers import eventually
from tests.test_tiered import entry

make = test_tiered.make  # the stores' fixture: RAM over LMDB, each value self-checking


class _PartlyTier(RamTier):
    """A second in-memory tier, named ``part``, whose keys starting with ``x`` are on a part
    that does not answer while ``out`` is set (as a dead Redis Cluster master's slots)."""

    name = "part"

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.out = True

    def put(self, key: bytes, value: bytes | Framed, *, ttl_s: float | None = None) -> None:
        if self.out and key.startswith(b"x"):
            raise PartlyUnavailable("this key's part does not answer")
        super().put(key, value, ttl_s=ttl_s)


@pytest.mark.parametrize("policy", list(WritePolicy))
def test_a_write_its_part_of_a_tier_did_not_take_is_retried(policy: WritePolicy) -> None:
    """Write-through copies and queued writes a part of the lower tier does not take are
    queued, retried and land once it answers, while the keys behind them land at once; none
    is dropped. A store still waiting at shutdown is dropped and counted."""
    lower = _PartlyTier()
    store = TieredStore([RamTier(1 << 20), lower], write_policy=policy, flush_timeout_s=0.5)
    store.put(b"x1", b"v1")
    store.put(b"a1", b"w1")
    store.put(b"a2", b"w2")
    assert eventually(lambda: lower.contains(b"a1") and lower.contains(b"a2"))
    assert store.queue_depth()["part"] == 1 and not lower.contains(b"x1")
    assert store.get(b"x1") == Hit(b"v1", "ram")
    assert store.counters["part.write_retried"] >= 1
    lower.out = False
    assert store.flush(5) and lower.get(b"x1") == b"v1"
    lower.out = True
    store.put(b"x2", b"v2")
    store.close()
    assert store.counters.get("part.write_dropped") == 1 and not lower.contains(b"x2")


def test_writes_dropped_with_the_queue_full_are_logged_and_retries_count_keys(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A part of the tier refusing writes for now (a full disk) with its queue full: the
    writes past the queue were dropped with no line saying so (only "queued, retried until they
    land"); now a WARNING, then one at most every ``WARN_EVERY_S`` saying how many went unsaid.
    The retry warning's count is of keys, not of tries (one key retried again and again was
    thousands of "writes")."""
    monkeypatch.setattr(queue, "RETRY_S", 0.001)  # retried many times within the test
    store = TieredStore([RamTier(1 << 20), _PartlyTier()], queue_entries=4, flush_timeout_s=0.2)
    try:
        with caplog.at_level(logging.WARNING, logger="kdn.store"):
            store.put(b"x0", b"v")  # retried while the part is out
            time.sleep(0.1)
            for i in range(1, 40):
                store.put(b"x%d" % i, b"v")
        dropped = [r.getMessage() for r in caplog.records if "was dropped" in r.getMessage()]
        assert len(dropped) == 1 and "its write queue is full" in dropped[0]
        assert store.counters["part.write_dropped"] == 40 - 4
        retried = [r.getMessage() for r in caplog.records if "not taken" in r.getMessage()]
        assert len(retried) == 1 and retried[0].startswith("tier part: 1 write(s) not taken")
        assert store.counters["part.write_retried"] > 4  # the tries, counted
    finally:
        store.close()


class _PartlyDeletesTier(_PartlyTier):
    """``part``, whose deletes of keys starting with ``x`` its dead part does not take."""

    def delete(self, key: bytes) -> bool:
        if self.out and key.startswith(b"x"):
            raise PartlyUnavailable("this key's part does not answer")
        return super().delete(key)


def test_deletes_that_could_not_be_queued_are_one_error_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """With the tier's queue full, each key of a delete that could not be queued was an ERROR
    line of its own (one Delete of 16,384 keys: 16,384 lines); now one, then one at most every
    ``WARN_EVERY_S`` saying how many went unsaid, each counted as ``delete_dropped``."""
    store = TieredStore([RamTier(1 << 20), _PartlyDeletesTier()], queue_entries=1,
                        flush_timeout_s=0.5)
    try:
        with caplog.at_level("ERROR", logger="kdn.store.lower"):
            for i in range(50):
                store.delete(b"x%d" % i)
        lines = [r for r in caplog.records if "could not be queued" in r.getMessage()]
        assert len(lines) == 1 and store.counters["part.delete_dropped"] == 49
    finally:
        store.close()


class _RefusingTier(RamTier):
    """A lower tier, named ``refusing``, that refuses every write and delete of keys starting
    with ``r`` (as a Redis refuses a key for good)."""

    name = "refusing"

    def put(self, key: bytes, value: bytes | Framed, *, ttl_s: float | None = None) -> None:
        if key.startswith(b"r"):
            raise KDNError("refused")
        super().put(key, value, ttl_s=ttl_s)

    def delete(self, key: bytes) -> bool:
        if key.startswith(b"r"):
            raise KDNError("refused")
        return super().delete(key)


def test_a_refused_write_and_the_delete_in_its_place_are_counted_once_each() -> None:
    """The write is ``write_dropped``; the delete of the stale copy queued in its place, refused
    too, is ``delete_dropped`` (it was counted as a second dropped write)."""
    lower = _RefusingTier(1 << 20)
    store = TieredStore([RamTier(1 << 20), lower])
    try:
        store.put(b"r1", b"v1")
        assert store.flush(5)
        assert eventually(lambda: store.counters.get("refusing.delete_dropped") == 1)
        assert store.counters.get("refusing.write_dropped") == 1, store.counters
    finally:
        store.close()


class _BuggyTier(RamTier):
    """A lower tier whose put of key ``bad`` raises what no tier should (a bug, not a kdn
    error)."""

    name = "buggy"

    def put(self, key: bytes, value: bytes | Framed, *, ttl_s: float | None = None) -> None:
        if key == b"bad":
            raise RuntimeError("a bug in the tier")
        super().put(key, value, ttl_s=ttl_s)


def test_a_tier_that_raises_an_unexpected_error_does_not_stop_the_queued_writes() -> None:
    """Under write-behind a queued write whose tier raised something other than a kdn error
    ended the writer thread: every later queued write stayed pending, never reached the
    tier. It is dropped and counted like a refused write, and the writes behind it land."""
    lower = _BuggyTier(1 << 20)
    store = TieredStore([RamTier(1 << 20), lower], write_policy=WritePolicy.WRITE_BEHIND)
    try:
        store.put(b"bad", b"v0")
        for i in range(5):
            store.put(b"k%d" % i, b"w%d" % i)
        assert store.flush(5), store.queue_depth()
        assert all(lower.get(b"k%d" % i) == b"w%d" % i for i in range(5))
        assert not lower.contains(b"bad") and store.counters["buggy.write_dropped"] == 1
        assert store.get(b"bad") == Hit(b"v0", "ram")  # the acknowledged value still served
    finally:
        store.close()


class _BuggyDiskTier(RamTier):
    """A durable lower tier, named ``buggy``, whose puts (and deletes, while ``bad_deletes``)
    of key ``bad`` raise what no tier should (a ValueError, as from inside its client
    library)."""

    name = "buggy"
    durable = True
    bad_deletes = False

    def put(self, key: bytes, value: bytes | Framed, *, ttl_s: float | None = None) -> None:
        if key == b"bad":
            raise ValueError("a bug in the tier's library")
        super().put(key, value, ttl_s=ttl_s)

    def delete(self, key: bytes) -> bool:
        if key == b"bad" and self.bad_deletes:
            raise ValueError("a bug in the tier's library")
        return super().delete(key)


def test_an_unexpected_error_of_a_lower_tier_is_its_refusal_after_ram_took_the_value(
        caplog: pytest.LogCaptureFixture) -> None:
    """A write-through store whose lower tier raised something other than a kdn error failed
    with it after the RAM tier took the new value: an error, yet readers were served the new
    value. It is that tier's refusal now: acknowledged from RAM, the tier's copy dropped and
    its older one deleted, logged once with its traceback. So for a delete: done, the tier's
    delete queued (and dropped, refused again). A DISK store that tier must acknowledge
    fails naming it, RAM untouched, and the put counts as under way no more (promotions are
    not held off)."""
    lower = _BuggyDiskTier(1 << 20)
    store = TieredStore([RamTier(1 << 20), lower])
    try:
        RamTier.put(lower, b"bad", b"old")
        assert store.put(b"bad", b"new") == "ram"
        assert store.get(b"bad") == Hit(b"new", "ram") and not lower.contains(b"bad")
        assert store.counters["buggy.write_dropped"] == 1
        bugs = [r for r in caplog.records if r.levelname == "ERROR" and r.exc_info]
        assert len(bugs) == 1 and "buggy" in bugs[0].getMessage(), caplog.text
        RamTier.put(lower, b"bad", b"old")
        lower.bad_deletes = True
        assert store.delete(b"bad")  # its delete there queued (and refused again: dropped)
        assert eventually(lambda: store.counters.get("buggy.delete_dropped") == 1)
        lower.bad_deletes = False
        store.delete(b"bad")
        with pytest.raises(KDNError, match="buggy tier failed unexpectedly: ValueError"):
            store.put(b"bad", b"newer", durability=Durability.DISK)
        assert store.get(b"bad") is None
        assert store._locks.settled(b"bad", store._locks.generation(b"bad"))
        with pytest.raises(KDNError, match="buggy tier failed unexpectedly"):
            store.put(b"bad", b"x" * 100, durability=Durability.DISK)
        assert store.flush(5)
    finally:
        store.close()


class _FailingEnv:
    """An LMDB environment whose read transactions fail as a disk does (``exc``); writes and
    everything else go to the real one."""

    def __init__(self, env: object, exc: Exception) -> None:
        self._env, self.exc, self.failing = env, exc, True

    def begin(self, *args: object, **kw: object) -> object:
        if self.failing and not kw.get("write"):
            raise self.exc
        return self._env.begin(*args, **kw)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._env, name)


@pytest.mark.parametrize("exc, down", [(lmdb.DiskError("EIO"), True),
                                       (lmdb.CorruptedError("bad page"), True),
                                       (lmdb.ReadersFullError("full"), False)])
def test_a_disk_read_that_fails_is_a_miss_of_that_tier_never_an_error(
        make: Callable[..., TieredStore], exc: Exception, down: bool) -> None:
    """A read LMDB fails (an I/O error, a damaged file, too many readers at once) is a miss of
    the disk tier, with the tier marked down where the whole tier is in doubt; values in RAM
    are served on, and once the disk reads again its entries come back."""
    store = make(ram=1 << 20)
    in_ram, on_disk = entry(100, 1), entry(100, 2)
    store.put(b"r" * 32, in_ram)
    store.put(b"d" * 32, on_disk)
    disk = store.tiers[1]
    assert isinstance(disk, LmdbTier)
    store.tiers[0].delete(b"d" * 32)  # only the disk holds it
    failing = _FailingEnv(disk.env, exc)
    disk.env = failing  # type: ignore[assignment]
    assert store.get(b"d" * 32) is None  # a miss, not lmdb's exception
    assert not store.lookup([b"d" * 32])[0].present
    hit = store.get(b"r" * 32)
    assert hit is not None and bytes(hit.value) == in_ram
    assert store.is_up(disk.name) != down
    failing.failing = False
    store.probe()
    assert store.is_up(disk.name)
    hit = store.get(b"d" * 32)
    assert hit is not None and bytes(hit.value) == on_disk


def test_a_default_store_the_disk_refuses_for_pinned_room_is_acked_with_a_warning(
        make: Callable[..., TieredStore], caplog: pytest.LogCaptureFixture) -> None:
    """Write-through, a disk tier full of pinned entries: a DEFAULT store smaller than
    ``disk_bytes`` is acknowledged from RAM (as one larger than ``disk_bytes`` is: README), and
    the warning says why, its size, and that the store is kept as a MEMORY one (a restart
    loses it); a DISK store of it fails."""
    store = make(ram=1 << 20, disk=60_000)
    ram, disk = store.tiers
    for i in range(5):
        store.put(b"pin/%d" % i, entry(10_000), pin=True)
    value = entry(20_000)
    with caplog.at_level("WARNING", logger="kdn.store.health"):
        assert store.put(b"new", value) == "ram"
    assert ram.get(b"new") == value and not disk.contains(b"new")
    said = [r.getMessage() for r in caplog.records if "b'new'" in r.getMessage()]
    assert said and "full of pinned entries" in said[0] and f"({len(value)} bytes)" in said[0] \
        and "kept as a MEMORY store is: a restart loses it" in said[0], said
    with pytest.raises(TooLarge):
        store.put(b"new2", value, durability=Durability.DISK)


def test_a_queued_overwrite_that_expires_deletes_the_older_copy() -> None:
    """An overwrite with a TTL its part of the lower tier did not take expires while queued: a
    delete takes its place, so the lower tier's older value never comes back."""
    lower = _PartlyTier()
    lower.out = False
    store = TieredStore([RamTier(1 << 20), lower])
    try:
        store.put(b"x1", b"old")
        assert lower.get(b"x1") == b"old"
        lower.out = True
        store.put(b"x1", b"new", ttl_s=0.2)
        assert store.queue_depth()["part"] == 1
        time.sleep(0.3)
        lower.out = False
        assert store.flush(5)
        assert not lower.contains(b"x1") and store.get(b"x1") is None
    finally:
        store.close()


def test_an_overwrite_the_full_disk_refused_deletes_the_older_copy_or_leaves_all(
        make: Callable[..., TieredStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    """Write-through, the disk full (its writes refused as LMDB refuses them on ENOSPC): a
    DEFAULT overwrite is acknowledged, its disk copy queued for a retry and the disk's older
    copy deleted at once, so a shutdown while the disk stays full (its queue dropped) leaves
    the key missing there, not the overwritten value. An overwrite no tier takes (larger than
    RAM holds) fails and leaves the previous value on disk."""
    store = make(ram=64 << 10, flush_timeout_s=0.3)
    disk = store.tiers[1]
    old, new = entry(1000), entry(1000)
    store.put(b"k", old)
    store.put(b"big", old)

    def full(*_: object, **__: object) -> None:
        raise PartlyUnavailable("disk tier write failed: No space left on device")

    monkeypatch.setattr(disk, "put_many", full)
    store.put(b"k", new)
    assert store.get(b"k").value == new  # type: ignore[union-attr]
    assert not disk.contains(b"k") and store.queue_depth()["disk"] == 1
    with pytest.raises(KDNError, match="does not answer now"):
        store.put(b"big", entry(100 << 10))
    assert disk.get(b"big") == old and store.queue_depth()["disk"] == 1
    store.close()
    again = LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)
    try:
        assert again.get(b"k") is None and again.get(b"big") == old
    finally:
        again.close()
