"""Group commit of the disk tier (``kdn.store.lmdbgroup``): writes that threads make at once
share committed transactions, each lands or fails on its own, and the tier's accounting,
eviction and map growth stay right. Real LMDB files under ``tmp_path``.

Where a test needs a group of known writes, it holds the tier's transactions back
(``_rw.exclusive()``: what a map growth holds) while a first write leads and the others
queue behind it; they are then committed together, in one transaction."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import lmdb
import pytest

from kdn.errors import PartlyUnavailable, TierUnavailable, TooLarge
from kdn.store.lmdb import LmdbTier
from tests.helpers import eventually

THREADS = 8


def commits(tier: LmdbTier) -> int:
    """Write transactions committed in the environment so far (LMDB's last transaction id)."""
    return int(tier.env.info()["last_txnid"])


def value(i: int) -> bytes:
    return bytes([i % 251]) * (1024 + (i * 37) % 3072)  # 1-4 KiB


@contextmanager
def grouped(tier: LmdbTier) -> Iterator[Callable[[Callable[[], None]], None]]:
    """Calls ``queue(write)`` queues behind a first write held back, committed together (as
    one group) once the block ends; each write's error is in ``errors`` by its name."""
    threads: list[threading.Thread] = []
    with tier._rw.exclusive():  # noqa: SLF001
        lead = threading.Thread(target=tier.put, args=(b"lead", b"x"))
        lead.start()
        assert eventually(lambda: tier._group.queued == 0 and tier._group._leading)  # noqa: SLF001

        def queue(write: Callable[[], None]) -> None:
            n = tier._group.queued  # noqa: SLF001
            t = threading.Thread(target=write)
            t.start()
            threads.append(t)
            assert eventually(lambda: tier._group.queued == n + 1)  # noqa: SLF001

        yield queue
    for t in [lead, *threads]:
        t.join(30)
        assert not t.is_alive()


def put_at_once(tier: LmdbTier, items: dict[bytes, bytes], per: int) -> None:
    """``THREADS`` threads put ``items`` (keys ``t<thread>-<i>``, ``per`` each), starting at
    once."""
    start = threading.Barrier(THREADS)

    def writer(t: int) -> None:
        start.wait()
        for i in range(per):
            key = b"t%d-%d" % (t, i)
            tier.put(key, items[key])

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def catching(errors: dict[str, BaseException], name: str, write: Callable[[], object]
             ) -> Callable[[], None]:
    def run() -> None:
        try:
            write()
        except BaseException as exc:
            errors[name] = exc
    return run


def test_concurrent_puts_share_commits_and_all_land_accounted(tmp_path: Path) -> None:
    """Threads writing at once commit fewer transactions than writes (one each before group
    commit), and every entry is readable, ``used`` is their sum, and all survive a reopen."""
    tier = LmdbTier(tmp_path, capacity_bytes=64 << 20)
    per = 60
    items = {b"t%d-%d" % (t, i): value(t * per + i) for t in range(THREADS) for i in range(per)}
    before = commits(tier)
    put_at_once(tier, items, per)
    done = commits(tier) - before
    assert done < len(items), f"{done} transactions for {len(items)} writes: none shared"
    total = sum(len(k) + len(v) for k, v in items.items())
    assert tier.stats().bytes == total and tier.stats().entries == len(items)
    assert all(tier.get(k) == v for k, v in items.items())
    tier.close()
    tier = LmdbTier(tmp_path, capacity_bytes=64 << 20)
    try:
        assert tier.stats().bytes == total
        assert all(tier.get(k) == v for k, v in items.items())
    finally:
        tier.close()


@pytest.mark.parametrize("bad", ["key LMDB refuses", "no room among pinned entries"])
def test_one_bad_write_in_a_group_fails_alone(tmp_path: Path, bad: str) -> None:
    """A write of a group that fails (LMDB refuses its key; its room is held by pinned
    entries) raises to its caller only; the writes before and after it in the same
    transaction land, and the accounting holds only them."""
    tier = LmdbTier(tmp_path, capacity_bytes=64 << 10, protected=lambda k: k.startswith(b"pin"))
    try:
        tier.put(b"pin", b"p" * (40 << 10))
        before = commits(tier)
        errors: dict[str, BaseException] = {}
        bad_key, bad_value = ((b"k" * 600, b"v") if bad.startswith("key")
                              else (b"big", b"b" * (30 << 10)))
        with grouped(tier) as queue:
            queue(catching(errors, "good1", lambda: tier.put(b"good1", b"1" * 1000)))
            queue(catching(errors, "bad", lambda: tier.put(bad_key, bad_value)))
            queue(catching(errors, "good2", lambda: tier.put(b"good2", b"2" * 2000)))
        assert set(errors) == {"bad"}
        assert isinstance(errors["bad"], PartlyUnavailable if bad.startswith("key") else TooLarge)
        assert commits(tier) - before == 2  # the lead's own, then the group of three
        assert tier.get(b"good1") == b"1" * 1000 and tier.get(b"good2") == b"2" * 2000
        assert tier.get(bad_key) is None and tier.get(b"pin") is not None
        held = [(b"pin", 40 << 10), (b"lead", 1), (b"good1", 1000), (b"good2", 2000)]
        assert tier.stats().bytes == sum(len(k) + n for k, n in held)
    finally:
        tier.close()


def test_a_group_past_the_map_ceiling_lands_each_write_that_fits(tmp_path: Path) -> None:
    """A group that fills the map is run again in a grown one; where the map can not grow
    enough for one of its writes, the group is run again one write at a time: that write is
    refused (``TooLarge``) and the others land."""
    tier = LmdbTier(tmp_path, capacity_bytes=16 << 20, initial_map_bytes=1 << 20,
                    max_map_bytes=4 << 20)
    try:
        errors: dict[str, BaseException] = {}
        with grouped(tier) as queue:
            for i in range(3):
                queue(catching(errors, f"a{i}", lambda i=i: tier.put(b"a%d" % i,
                                                                    b"a" * (400 << 10))))
            queue(catching(errors, "huge", lambda: tier.put(b"huge", b"h" * (6 << 20))))
            queue(catching(errors, "b", lambda: tier.put(b"b", b"b" * 1000)))
        assert set(errors) == {"huge"} and isinstance(errors["huge"], TooLarge)
        assert tier.map_size > 1 << 20
        assert all(tier.get(b"a%d" % i) == b"a" * (400 << 10) for i in range(3))
        assert tier.get(b"b") == b"b" * 1000 and tier.get(b"huge") is None
        assert tier.stats().bytes == 5 + 3 * (2 + (400 << 10)) + 1 + 1000
    finally:
        tier.close()


def test_budget_eviction_under_concurrent_puts(tmp_path: Path) -> None:
    """Threads writing at once past the budget: unpinned entries are evicted, each counted
    once, the pinned ones stay, what is held is what was written, and ``used`` is its sum."""
    cap = 96 << 10
    tier = LmdbTier(tmp_path, capacity_bytes=cap, protected=lambda k: k.startswith(b"pin"))
    try:
        pins = {b"pin%d" % i: b"p" * 4000 for i in range(4)}
        for k, v in pins.items():
            tier.put(k, v)
        per = 40
        items = {b"t%d-%d" % (t, i): value(t * per + i) for t in range(THREADS)
                 for i in range(per)}
        put_at_once(tier, items, per)
        held = {k: tier.get(k) for k in tier.keys()}
        assert all(held.get(k) == v for k, v in pins.items())
        assert all(v == (pins.get(k) or items[k]) for k, v in held.items())
        used = sum(len(k) + len(v) for k, v in held.items() if v is not None)
        assert tier.stats().bytes == used <= cap
        assert tier.counters.evictions == len(items) + len(pins) - len(held) > 0
    finally:
        tier.close()


def test_a_single_writer_commits_each_write_alone(tmp_path: Path) -> None:
    """One thread's writes are each one transaction of their own, as without grouping."""
    tier = LmdbTier(tmp_path, capacity_bytes=1 << 20)
    try:
        before = commits(tier)
        for i in range(20):
            tier.put(b"k%d" % i, value(i))
        tier.delete(b"k0")
        assert commits(tier) - before == 21
    finally:
        tier.close()


def test_evictions_of_a_group_run_again_are_counted_once(tmp_path: Path) -> None:
    """A group whose write filled the map is run again in a grown one: its evictions were
    counted by each run (10 counted for 8 made here); they are counted once committed."""
    tier = LmdbTier(tmp_path, capacity_bytes=700 << 10, initial_map_bytes=1 << 20)
    try:
        for i in range(6):
            tier.put(b"k%d" % i, bytes([i]) * (100 << 10))
        before = tier.counters.evictions
        grown: list[str] = []
        tier.on_event = lambda name, n: grown.append(name)
        with grouped(tier) as queue:
            queue(lambda: tier.put(b"A", b"A" * (250 << 10)))  # evicts two
            queue(lambda: tier.put(b"B", b"B" * (500 << 10)))  # fills the map: run again
        assert "map_grown" in grown
        made = 6 + 3 - len(set(tier.keys()))
        assert tier.counters.evictions - before == made
    finally:
        tier.close()


def test_an_interrupted_leader_fails_only_the_writes_it_left(tmp_path: Path) -> None:
    """The group's commit fails, its writes are run again alone, and an interrupt hits the
    leader (one of the group's writers) on the last: every write of the group was failed with a
    bare RuntimeError, those committed alone too (stored, yet reported failed). Those stand;
    the one left fails as TierUnavailable, and the interrupt reaches the leader."""
    tier = LmdbTier(tmp_path, capacity_bytes=1 << 20)
    real, calls = tier._transact, []  # noqa: SLF001

    def faulty(run: object, need: int, quiet: bool = False) -> None:
        calls.append(need)
        if len(calls) == 2:  # the group's transaction
            raise lmdb.Error("mdb_txn_commit: Input/output error")
        if len(calls) == 5:  # its third write, run alone
            raise KeyboardInterrupt
        real(run, need, quiet)  # type: ignore[arg-type]

    tier._group._transact = faulty  # type: ignore[assignment]  # noqa: SLF001

    def putting(name: str) -> Callable[[], None]:
        return lambda: tier.put(name.encode(), name.encode() * 8)
    errors: dict[str, BaseException] = {}
    try:
        with tier._rw.exclusive():  # noqa: SLF001
            lead = threading.Thread(target=catching(errors, "lead", lambda: tier.put(b"L", b"x")))
            lead.start()
            assert eventually(lambda: tier._group.queued == 0 and tier._group._leading)  # noqa: SLF001
            writers = []
            for name in "ABC":
                n = tier._group.queued  # noqa: SLF001
                writers.append(threading.Thread(target=catching(errors, name, putting(name))))
                writers[-1].start()
                assert eventually(lambda n=n: tier._group.queued == n + 1)  # noqa: SLF001
        for t in [lead, *writers]:
            t.join(10)
        led = [n for n, e in errors.items() if isinstance(e, KeyboardInterrupt)]
        assert len(led) == 1 and set(errors) <= {"C", *led}, errors
        assert isinstance(errors["C"], (TierUnavailable, KeyboardInterrupt)), errors
        assert [tier.get(k) is not None for k in (b"A", b"B", b"C")] == [True, True, False]
    finally:
        tier._group._transact = real  # type: ignore[assignment]  # noqa: SLF001
        tier.close()
