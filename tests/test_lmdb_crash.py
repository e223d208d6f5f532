"""The LMDB disk tier across restarts and SIGKILL: a child process (this module run as a script)
writes in a loop and prints each key after its put returns; the parent kills it with SIGKILL
at a random point, reopens the data directory and checks that every acknowledged entry is
there and intact, that nothing partial is readable, and that the byte accounting still adds up.
Plus restart persistence, map growth, budget eviction order surviving a restart, and a data
directory deleted under a running server (no DISK store acknowledged into a file no restart
opens)."""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.errors import KDNError, Status, TierUnavailable
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.store.lmdb import LmdbTier
from tests.helpers import eventually, random_kv, uniform_layout

ROOT = Path(__file__).resolve().parent.parent


def value_for(i: int, version: int = 0) -> bytes:
    """Deterministic content of entry ``i``: 1 KiB .. ~513 KiB of a repeated digest."""
    size = 1024 + (i * 7919 + version * 104729) % (512 << 10)
    d = hashlib.blake2b(b"%d/%d" % (i, version)).digest()
    return (d * (size // len(d) + 1))[:size]


def _child(mode: str, path: str, start: int) -> None:
    """Write entries start, start+1, ... forever; print "k <i>" / "hot <v>" after each ack."""
    from kdn.store.ram import RamTier
    from kdn.store.tiered import Durability, TieredStore, WritePolicy

    cap = 6 << 20 if mode == "evict" else 1 << 30
    disk = LmdbTier(path, capacity_bytes=cap, initial_map_bytes=4 << 20)
    store = None
    if mode == "store":
        store = TieredStore([RamTier(2 << 20), disk], write_policy=WritePolicy.WRITE_BEHIND)
    i = start
    while True:
        key, value, line = b"k/%d" % i, value_for(i), f"k {i}"
        if i % 5 == 0:  # overwrite one hot key with ever newer versions
            key, value, line = b"hot", value_for(0, i), f"hot {i}"
        if store is not None:
            store.put(key, value, durability=Durability.DISK)
        else:
            disk.put(key, value)
        print(line, flush=True)
        i += 1


def _crash_round(mode: str, path: Path, start: int, acks_wanted: int) -> tuple[list[int], int]:
    """Run the child until ``acks_wanted`` acks, SIGKILL it; (acked entries, last hot ver)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.test_lmdb_crash", mode, str(path), str(start)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    acked: list[int] = []
    hot = -1
    try:
        assert proc.stdout is not None
        for n, line in enumerate(proc.stdout, start=1):
            kind, num = line.split()
            if kind == "k":
                acked.append(int(num))
            else:
                hot = int(num)
            if n >= acks_wanted:
                proc.send_signal(signal.SIGKILL)  # mid-loop: the next put is under way
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.read() if proc.stderr else ""
    return acked, hot


def _check_intact(tier: LmdbTier, upto: int) -> dict[int, bool]:
    """Every entry present is byte-exact; the byte accounting matches what is stored."""
    present: dict[int, bool] = {}
    total = 0
    for key in tier.keys(b""):
        value = tier.get(key)
        assert value is not None
        total += len(key) + len(value)
        if key == b"hot":
            assert any(value == value_for(0, v) for v in range(0, upto, 5)), "hot key damaged"
            continue
        i = int(key.split(b"/")[1])
        assert value == value_for(i), f"entry {i} is damaged"
        present[i] = True
    assert tier.stats().bytes == total
    return present


@pytest.mark.parametrize("mode", ["tier", "store"])
def test_sigkill_mid_writes_loses_no_acknowledged_entry(tmp_path: Path, mode: str) -> None:
    rng = random.Random(7)
    path = tmp_path / "lmdb"
    acked_all: list[int] = []
    start = 0
    for _ in range(2):
        acked, hot = _crash_round(mode, path, start, rng.randrange(25, 60))
        acked_all += acked
        start = max(acked_all) + 10
        tier = LmdbTier(path, capacity_bytes=1 << 30)
        try:
            present = _check_intact(tier, start)
            missing = [i for i in acked_all if i not in present]
            assert not missing, f"acknowledged entries lost: {missing}"
            if hot >= 0:
                got = tier.get(b"hot")
                assert got is not None
                assert any(got == value_for(0, v) for v in range(hot, start, 5))
        finally:
            tier.close()


def test_sigkill_during_eviction_keeps_budget_and_accounting(tmp_path: Path) -> None:
    path = tmp_path / "lmdb"
    acked, _ = _crash_round("evict", path, 0, 60)
    tier = LmdbTier(path, capacity_bytes=6 << 20)
    try:
        _check_intact(tier, 10_000)
        st = tier.stats()
        assert 0 < st.bytes <= 6 << 20
        assert tier.get(b"k/%d" % acked[-1]) == value_for(acked[-1])  # newest is kept
    finally:
        tier.close()


def test_restart_keeps_entries_accounting_and_ttl(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, capacity_bytes=1 << 20)
    tier.put(b"a", b"x" * 1000)
    tier.put(b"t", b"y" * 10, ttl_s=3600)
    before = tier.stats()
    tier.close()
    tier = LmdbTier(tmp_path, capacity_bytes=1 << 20)
    try:
        assert tier.get(b"a") == b"x" * 1000
        ttl = tier.ttl_remaining(b"t")
        assert ttl is not None and 3500 < ttl <= 3600
        assert tier.stats().bytes == before.bytes and tier.stats().entries == 2
    finally:
        tier.close()


def test_map_grows_on_demand(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, capacity_bytes=64 << 20, initial_map_bytes=1 << 20)
    start = tier.map_size
    values = {b"g/%d" % i: os.urandom(512 << 10) for i in range(40)}
    for k, v in values.items():
        tier.put(k, v)
    assert tier.map_size > start
    assert all(tier.get(k) == v for k, v in values.items())
    tier.close()


def test_eviction_order_survives_restart(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, capacity_bytes=50_000)
    for i in range(4):
        tier.put(b"e/%d" % i, bytes(10_000))
    tier.get(b"e/0")  # e/0 is now the most recently used
    tier.close()  # access stamps are flushed at close
    tier = LmdbTier(tmp_path, capacity_bytes=50_000)
    try:
        tier.put(b"e/4", bytes(10_000))
        tier.put(b"e/5", bytes(10_000))
        assert tier.contains(b"e/0")
        assert not tier.contains(b"e/1")
        assert tier.stats().bytes <= 50_000
    finally:
        tier.close()


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))


def test_deleted_data_dir_refuses_disk_stores_and_fails_health(tmp_path: Path) -> None:
    """The data directory removed under a running server: the file LMDB writes to is
    unlinked, so a DISK store "committed" there is gone at the next restart. It must be
    refused (UNAVAILABLE) at once, and the health probe must mark the disk tier down."""
    lay = uniform_layout()
    ks = [keys.chunk_key([i], lay) for i in range(3)]
    disk = StoreOptions(durability=Durability.DISK)
    cfg = ServerConfig(port=0, data_port=-1, data_dir=tmp_path / "data")
    with ServerThread(cfg) as st, Client(st.address, timeout_s=10) as c:
        c.store(ks[0], random_kv(lay, 8, seed=0), options=disk)
        shutil.rmtree(tmp_path / "data")
        for i, k in enumerate(ks[1:], start=1):  # the first finds it in the write, then down
            with pytest.raises(KDNError) as info:
                c.store(k, random_kv(lay, 8, seed=i), options=disk)
            assert info.value.status is Status.UNAVAILABLE
        assert eventually(lambda: c.health() == "NOT_SERVING", timeout=10)
    tier = LmdbTier(tmp_path / "again", capacity_bytes=1 << 20)
    assert tier.healthy()
    shutil.rmtree(tmp_path / "again")
    assert not tier.healthy()
    with pytest.raises(TierUnavailable, match="removed or replaced"):
        tier.put(b"k", b"v")
    with pytest.raises(TierUnavailable):  # its access stamps can not be kept either
        tier.close()


def test_a_write_while_the_folder_is_moved_is_rolled_back(tmp_path: Path) -> None:
    """The folder moved away under an open tier: a write fails, and its transaction is
    rolled back, not committed into the moved file: once the folder is back (or the tier is
    opened where it now is) neither a failed overwrite nor a failed new key is there."""
    tier = LmdbTier(tmp_path / "a" / "lmdb", capacity_bytes=1 << 20)
    tier.put(b"old", b"v1")
    os.rename(tmp_path / "a", tmp_path / "b")
    for key, value in ((b"old", b"v2"), (b"new", b"v3")):
        with pytest.raises(TierUnavailable, match="removed or replaced"):
            tier.put(key, value)
    with pytest.raises(TierUnavailable):
        tier.delete(b"old")
    os.rename(tmp_path / "b", tmp_path / "a")
    assert tier.healthy()
    assert tier.get(b"old") == b"v1" and tier.get(b"new") is None
    tier.close()
    again = LmdbTier(tmp_path / "a" / "lmdb", capacity_bytes=1 << 20)
    try:
        assert again.get(b"old") == b"v1" and again.get(b"new") is None
    finally:
        again.close()


def test_a_file_or_a_dangling_link_where_the_folder_belongs_is_named(tmp_path: Path) -> None:
    """mkdir said only "File exists"; the error names the path and what it is."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(TierUnavailable, match=f"{tmp_path / 'dangling'} is a link to nothing"):
        LmdbTier(tmp_path / "dangling" / "lmdb", capacity_bytes=1 << 20)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "lmdb").write_text("a file")
    with pytest.raises(TierUnavailable, match=f"{tmp_path / 'd' / 'lmdb'} is not a folder"):
        LmdbTier(tmp_path / "d" / "lmdb", capacity_bytes=1 << 20)


def test_a_data_file_that_can_not_be_written_is_an_os_error_naming_it(tmp_path: Path) -> None:
    """As the lock file's (``kdn serve`` exits 1 naming the file), not "can not open LMDB"
    (a TierUnavailable, which ``kdn serve`` took for a bad configuration: exit 2)."""
    LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20).close()
    data = tmp_path / "lmdb" / "data.mdb"
    data.chmod(0o400)
    immutable = os.access(data, os.W_OK)  # root: the mode does not stop it
    if immutable and subprocess.run(["chattr", "+i", str(data)], capture_output=True).returncode:
        pytest.skip("root, and no chattr +i here")
    try:
        with pytest.raises(OSError) as info:
            LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)
        assert info.value.filename == str(data) and info.value.errno in (1, 13), info.value
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(data)], check=True)
