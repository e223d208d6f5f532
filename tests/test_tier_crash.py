"""An acknowledged overwrite across a SIGKILL of the store's process: a child process (this
module run as a script) stores an older version of each key, then a newer one, prints "acked"
and kills itself with its write queues' copies not landed; the parent opens the same LMDB (and
Redis) again and reads each key as a restarted server would. It holds the newer version, or
(where only a queued copy could hold it) nothing, never the older one: a disk full when the
overwrite came (its write refused as LMDB refuses one on ENOSPC, then retried from the queue),
and write-behind with Redis, where a DISK (or SHARED) store's tiers read before the one it needs
held older copies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from kdn.store.base import Tier
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.redis import RedisTier
from kdn.store.tiered import Durability, TieredStore, WritePolicy
from tests.redis_servers import RedisServer, redis_server_fixture  # noqa: F401

ROOT = Path(__file__).resolve().parent.parent
KEYS = [b"default/k%d" % i for i in range(20)]


def _old(key: bytes) -> bytes:
    return b"old:" + key * 100


def _new(key: bytes) -> bytes:
    return b"new:" + key * 120


def _tiers(order: str, path: str, url: str) -> list[Tier]:
    """RAM, then the lower tiers named in ``order`` (``disk``, ``redis``), in read order."""
    lower: dict[str, Tier] = {"disk": LmdbTier(path, capacity_bytes=64 << 20)}
    if "redis" in order:
        lower["redis"] = RedisTier(url)
    return [RamTier(8 << 20), *(lower[name] for name in order.split(","))]


def _stall_queues() -> None:
    """From now on, a write queue's writer stops before landing anything: what is queued is
    still queued at the kill (its writer holds no key's lock while it waits)."""
    from kdn.store.queue import WriteQueue

    real, never = WriteQueue._next, threading.Event()

    def stalled(self: WriteQueue) -> bytes | None:
        key = real(self)
        never.wait()
        return key

    WriteQueue._next = stalled  # type: ignore[method-assign]


def _child(case: str, order: str, path: str, url: str) -> None:
    """Store the older versions, then the newer ones as ``case`` says, print "acked", die."""
    from kdn.errors import PartlyUnavailable

    policy = WritePolicy.WRITE_BEHIND if case != "full" else WritePolicy.WRITE_THROUGH
    tiers = _tiers(order, path, url)
    store = TieredStore(tiers, write_policy=policy)
    for key in KEYS:
        store.put(key, _old(key), durability=Durability.DISK)
    assert store.flush(10)
    _stall_queues()
    durability = Durability.DISK
    if case == "full":
        def full(*_: object, **__: object) -> None:  # LmdbTier's words for an ENOSPC
            raise PartlyUnavailable("disk tier write failed: mdb_txn_commit: No space left "
                                    "on device (the disk is full: 0 bytes free)")

        next(t for t in tiers if t.name == "disk").put_many = full  # type: ignore[method-assign]
        durability = Durability.DEFAULT
    elif case == "shared":
        durability = Durability.SHARED
    for key in KEYS:
        store.put(key, _new(key), durability=durability)
        assert store.get(key).value == _new(key)  # type: ignore[union-attr]
    print("acked", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def _crash(case: str, order: str, path: Path, url: str = "") -> dict[bytes, bytes | None]:
    """Run the child, then read every key through a store over the same tiers."""
    proc = subprocess.run([sys.executable, "-m", "tests.test_tier_crash", case, order,
                           str(path), url], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGKILL and "acked" in proc.stdout, proc.stderr[-2000:]
    store = TieredStore(_tiers(order, str(path), url))
    try:
        got = {key: store.get(key) for key in KEYS}
        return {key: None if hit is None else bytes(hit.value) for key, hit in got.items()}
    finally:
        store.close()


@pytest.mark.parametrize("order", ["disk", "redis,disk"])
def test_an_overwrite_the_full_disk_did_not_take_never_brings_back_the_older(
        tmp_path: Path, order: str, request: pytest.FixtureRequest) -> None:
    """Write-through, the disk full: a DEFAULT overwrite is acknowledged with its disk copy
    queued for a retry; the disk's older copy is deleted at once, so the kill that drops the
    queue leaves the key missing there (Redis, where there is one, serves the newer), never the
    overwritten value. It was kept, hidden only by the queued copy, and served again after the
    restart (or once Redis evicted its copy)."""
    url = request.getfixturevalue("redis_server").url if "redis" in order else ""
    got = _crash("full", order, tmp_path / "lmdb", url)
    assert got == {k: None if order == "disk" else _new(k) for k in KEYS}
    disk = LmdbTier(tmp_path / "lmdb", capacity_bytes=64 << 20)
    try:
        assert [k for k in KEYS if disk.contains(k)] == []
    finally:
        disk.close()


@pytest.mark.parametrize("order, case", [("redis,disk", "disk"), ("disk,redis", "shared")])
def test_a_durable_write_behind_store_is_not_hidden_by_an_older_copy_read_first(
        tmp_path: Path, redis_server: RedisServer, order: str, case: str) -> None:
    """Write-behind: a DISK store (RAM, Redis, disk) or a SHARED one (RAM, disk, Redis) is
    acknowledged once the tier it needs has it; the tier read before that one is written
    before the answer too. It was only queued, so after a kill it served the older version
    ahead of the acknowledged one."""
    got = _crash(case, order, tmp_path / "lmdb", redis_server.url)
    assert got == {k: _new(k) for k in KEYS}


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] if len(sys.argv) > 4 else "")
