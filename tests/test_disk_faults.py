"""The disk tier's storage misbehaving under a real ``kdn serve``: its filesystem full (a
tmpfs of its own, mounted in a user and mount namespace: skipped where that is not allowed),
its data file cut short (a page past the file's end is a SIGBUS in LMDB's map, which kills
the process), refused writes that reach a same-host client as the server's answer. Real
processes, real LMDB files, real clients."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdn import keys
from kdn.cache import KVCache
from kdn.client import Client, Retry
from kdn.errors import KDNError, Status, TierUnavailable
from kdn.options import Durability, StoreOptions
from kdn.server import ServerConfig, ServerThread
from kdn.server.app import build_store
from kdn.store.lmdb import LmdbTier

from .helpers import eventually, random_kv, uniform_layout

LAYOUT = uniform_layout(layers=4, heads=8, dim=64)
TOKENS = 256  # a 1 MiB entry in raw


def _entries(n: int, tag: int) -> dict[bytes, KVCache]:
    return {keys.chunk_key([i, tag], LAYOUT): random_kv(LAYOUT, TOKENS, seed=i) for i in range(n)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(data: Path, port: int, *, tmpfs_bytes: int = 0, fill: Path | None = None
           ) -> subprocess.Popen[str]:
    """``kdn serve`` on ``data``; with ``tmpfs_bytes``, on a tmpfs of that size mounted at
    ``data`` in a mount namespace of its own, which a file written there fills to the last
    byte once ``fill`` exists (outside it: the test's side of the namespace)."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "kdn", "serve", "--port", str(port), "--ram-bytes", "4MiB",
           "--data-dir", str(data)]
    if tmpfs_bytes:
        data.mkdir()
        filler = ('(while [ ! -e "$1" ]; do kill -0 $$ 2>/dev/null || exit 0; sleep 0.05; '
                  'done; dd if=/dev/zero of="$0/filler" bs=64k 2>/dev/null; touch "$1.done") & ')
        cmd = ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
               f'mount -t tmpfs -o size={tmpfs_bytes} tmpfs "$0" && {filler}shift && exec "$@"',
               str(data), str(fill or data / "never"), *cmd]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)


def _refused_at_start(data: Path, port: int) -> tuple[int | None, str]:
    """``kdn serve`` on ``data`` run until it exits: its exit code and what it printed."""
    proc = _serve(data, port)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err


def _serving(address: str, proc: subprocess.Popen[str]) -> bool:
    """Whether ``kdn serve`` answers SERVING before it exits (or 30 s pass)."""
    end = time.monotonic() + 30
    while time.monotonic() < end and proc.poll() is None:
        try:
            with Client(address, timeout_s=1, shm_bytes=0, data_path=False,
                        retry=Retry(retries=0)) as probe:
                if probe.health() == "SERVING":
                    return True
        except KDNError:
            time.sleep(0.05)
    return False


def test_a_full_filesystem_is_named_and_what_is_stored_stays_served(tmp_path: Path) -> None:
    """The disk tier's filesystem (24 MiB) under the default 16 GiB budget: the budget is cut
    to what the filesystem holds, so 40 MiB of DISK stores all land, the oldest evicted. Then
    another file fills the filesystem: a DISK store past it is UNAVAILABLE naming the full disk
    and its free bytes (LMDB's own words are "Input/output error"), the entries stored before
    are served bit-identical, the server stays SERVING, and once entries are deleted the freed
    pages take DISK stores again."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    data, fill = tmp_path / "data", tmp_path / "fill"
    port = _free_port()
    address = f"127.0.0.1:{port}"
    proc = _serve(data, port, tmpfs_bytes=24 << 20, fill=fill)
    try:
        if not _serving(address, proc):
            pytest.skip(f"no tmpfs in a mount namespace here: {proc.stderr.read()[-300:]}"
                        if proc.stderr else "no tmpfs")
        disk = StoreOptions(durability=Durability.DISK)
        with Client(address, timeout_s=10) as c:
            first = _entries(40, tag=2)
            for k, kv in first.items():  # 40 MiB on a 24 MiB filesystem: the oldest go
                c.store(k, kv, mode="raw", options=disk)
            last = list(first)[-6:]
            assert all(c.retrieve(k).equal(first[k]) for k in last)  # type: ignore[union-attr]
            budget = c.stats().tiers[-1].capacity_bytes
            assert 8 << 20 < budget <= 18 << 20, budget
            assert c.delete(list(first)) >= 8
            fill.touch()
            assert eventually(lambda: fill.with_suffix(".done").exists(), timeout=10)
            stored: dict[bytes, KVCache] = {}
            for k, kv in _entries(40, tag=3).items():
                try:
                    c.store(k, kv, mode="raw", options=disk)
                except KDNError as exc:
                    refusal = exc
                    break
                stored[k] = kv
            else:
                raise AssertionError("40 MiB stored on a full filesystem")
            assert refusal.status is Status.UNAVAILABLE, refusal
            assert "the disk is full" in str(refusal) and "bytes free on the filesystem of" \
                in str(refusal), refusal
            assert len(stored) >= 4 and c.health("kdn.v1.KDN") == "SERVING"
            got = {k: c.retrieve(k) for k in stored}  # the oldest may have been evicted
            assert all(g is None or g.equal(stored[k]) for k, g in got.items())
            assert all(got[k] is not None for k in list(stored)[-4:])
            held = [k for k in stored if got[k] is not None]
            gone = held[: len(held) // 2 + 1]
            assert c.delete(gone) == len(gone)
            for k, kv in list(_entries(len(gone) - 1, tag=4).items()):
                c.store(k, kv, mode="raw", options=disk)
    finally:
        proc.terminate()
        proc.wait(30)


def test_a_data_file_cut_short_is_refused_not_read_into_a_crash(tmp_path: Path) -> None:
    """``data.mdb`` truncated under a running server: the probe marks the disk tier down and
    reads go to the other tiers (LMDB's lost pages, read, are a SIGBUS that kills the server);
    at restart the file is refused with one line naming it, instead of a server that starts,
    serves, and dies at its first read of a lost page, restart after restart."""
    data = tmp_path / "data"
    port = _free_port()
    address = f"127.0.0.1:{port}"
    stored = _entries(24, tag=1)
    proc = _serve(data, port)
    try:
        assert _serving(address, proc), proc.stderr.read() if proc.stderr else ""
        with Client(address, timeout_s=5) as c:
            for k, kv in stored.items():
                c.store(k, kv, mode="raw")
            (data_file,) = data.rglob("data.mdb")
            os.truncate(data_file, data_file.stat().st_size // 4)
            assert eventually(lambda: c.health("kdn.v1.KDN") == "NOT_SERVING", timeout=5)
            served = 0
            for k, kv in stored.items():
                got = c.retrieve(k)  # from RAM, or a miss: never a read of the lost pages
                assert proc.poll() is None, f"kdn serve died reading: {proc.returncode}"
                if got is not None:
                    assert got.equal(kv)
                    served += 1
            assert served < len(stored)  # the disk tier's entries are misses now
    finally:
        proc.terminate()
        proc.wait(30)
    code, err = _refused_at_start(data, port)
    assert code == 2, err
    assert "was truncated" in err and str(data_file) in err and "Traceback" not in err, err


def test_a_truncated_file_is_named_with_both_sizes(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, capacity_bytes=64 << 20, sync=False)
    for i in range(16):
        tier.put(b"k%d" % i, os.urandom(100_000))
    tier.close()
    size = (tmp_path / "data.mdb").stat().st_size
    os.truncate(tmp_path / "data.mdb", size // 2)
    with pytest.raises(TierUnavailable, match=f"holds {size // 2} bytes, but its pages reach "
                                              f"{size}: the file was truncated"):
        LmdbTier(tmp_path, capacity_bytes=64 << 20)
    os.truncate(tmp_path / "data.mdb", size)  # its pages back (as zeros): it opens again
    LmdbTier(tmp_path, capacity_bytes=64 << 20).close()


def test_a_file_cut_to_its_meta_pages_is_refused_not_a_sigbus(tmp_path: Path) -> None:
    """Cut to 8 KiB (its two meta pages) or 16 KiB, the data file killed the opening process
    with SIGBUS: opening a database read its root page, past the end, before the size was
    checked. Opened in a child here, so that a SIGBUS fails the test, not the run."""
    tier = LmdbTier(tmp_path, capacity_bytes=64 << 20, sync=False)
    for i in range(20):
        tier.put(b"k%d" % i, os.urandom(5_000))
    tier.close()
    for cut in (16384, 8192, 7547):
        os.truncate(tmp_path / "data.mdb", cut)
        probe = subprocess.run(
            [sys.executable, "-c", "import sys\nfrom kdn.store.lmdb import LmdbTier\n"
             "from kdn.errors import TierUnavailable\n"
             f"try:\n    LmdbTier({str(tmp_path)!r}, capacity_bytes=64 << 20)\n"
             "except TierUnavailable as e:\n    print(e)\n"],
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert probe.returncode == 0, (cut, probe.returncode, probe.stderr[-500:])
        assert f"holds {cut} bytes" in probe.stdout and "was truncated" in probe.stdout


def test_a_meta_record_of_another_length_is_a_miss_not_an_error(tmp_path: Path) -> None:
    """One damaged meta record raised struct.error out of get, contains, keys and the
    tier's stats: every read of it, and admin ls, verify, stats and gc, failed as UNKNOWN.
    It reads as an entry expired long ago: a miss, listed nowhere, the others served."""
    import lmdb

    tier = LmdbTier(tmp_path, capacity_bytes=64 << 20, sync=False)
    tier.put(b"bad", b"v" * 4000)
    tier.put(b"good", b"w" * 4000)
    tier.close()
    env = lmdb.open(str(tmp_path), max_dbs=4)
    meta = env.open_db(b"meta")
    with env.begin(write=True, db=meta) as txn:
        txn.put(b"bad", b"\x01" * 7)  # neither record length
    env.close()
    tier = LmdbTier(tmp_path, capacity_bytes=64 << 20, sync=False)
    assert tier.get(b"bad") is None and not tier.contains(b"bad")
    assert tier.get(b"good") == b"w" * 4000
    assert list(tier.keys()) == [b"good"] and tier.stats().name == "disk"
    tier.close()


def test_a_zeroed_data_file_is_named_damaged_with_what_to_do(tmp_path: Path) -> None:
    """A data file overwritten with zeros (a disk or a program that wrote over it) is refused
    as damaged, naming its folder and what to do about it (it only said "File is not an LMDB
    file", restart after restart), by the tier and by ``kdn serve`` in one line; once the
    folder is moved aside, the server starts with an empty disk tier."""
    data = tmp_path / "data"
    LmdbTier(data / "lmdb", capacity_bytes=64 << 20).close()
    (data_file,) = data.rglob("data.mdb")
    data_file.write_bytes(bytes(data_file.stat().st_size))
    with pytest.raises(TierUnavailable, match=r"its data file is damaged \(.*\); move the "
                                              r"folder aside to start with an empty disk tier"):
        LmdbTier(data / "lmdb", capacity_bytes=64 << 20)
    port = _free_port()
    code, err = _refused_at_start(data, port)
    assert code == 2, err
    assert "damaged" in err and str(data_file.parent) in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    (data / "lmdb").rename(tmp_path / "aside")
    proc = _serve(data, port)
    try:
        assert _serving(f"127.0.0.1:{port}", proc), proc.stderr.read() if proc.stderr else ""
    finally:
        proc.terminate()
        proc.wait(30)


def test_stores_the_disk_tier_refuses_keep_the_clients_shared_segment(tmp_path: Path) -> None:
    """A DISK store the disk tier refuses (its folder deleted under the server: UNAVAILABLE)
    is the server's answer: the same-host client's region for it is free again, not retired
    as if the server might still read it (each refusal kept an entry's bytes of the segment
    out of use for good, until the segment was used up)."""
    disk = StoreOptions(durability=Durability.DISK)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", shutdown_grace_s=1)
    refused = _entries(12, tag=2)
    with ServerThread(cfg) as st, Client(st.address, timeout_s=10, shm_bytes=16 << 20) as c:
        seg, _ = c.dataplane.segment()
        assert seg is not None and c.dataplane.same_host.fast
        shutil.rmtree(tmp_path / "data")
        for k, kv in refused.items():
            with pytest.raises(KDNError) as info:
                c.store(k, kv, mode="raw", options=disk)
            assert info.value.status is Status.UNAVAILABLE, info.value
            assert "disk tier" in str(info.value)
        assert seg.regions.retired_bytes() == 0
        assert seg.regions.largest_free() >= 15 << 20


@pytest.mark.parametrize("free_pages", [0, 1])
def test_a_filesystem_full_at_first_start_is_one_line_naming_it(tmp_path: Path,
                                                               free_pages: int) -> None:
    """``kdn serve`` on a full filesystem (none free: the data folder's lock can not be written;
    a page free: LMDB's lock file can not be had whole) exits 1 with one line saying the disk
    is full and naming the folder. It was a SIGBUS inside ``lmdb.open`` (LMDB's sparse lock
    file, written through its map: exit -7, no word), a bare "No space left on device", or
    "bad configuration" (exit 2)."""
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    count = 256 - free_pages if free_pages else 1 << 20  # a 1 MiB tmpfs of 4 KiB pages
    proc = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
         'mount -t tmpfs -o size=1m tmpfs "$0" || exit 99; '
         'dd if=/dev/zero of="$0/filler" bs=4096 count="$1" 2>/dev/null; shift; exec "$@"',
         str(mnt), str(count), sys.executable, "-m", "kdn", "serve", "--port", "0",
         "--data-dir", str(mnt / "data")],
        env=env, capture_output=True, text=True, timeout=60)
    if proc.returncode == 99:
        pytest.skip(f"no tmpfs in a mount namespace here: {proc.stderr[-300:]}")
    line = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "the disk is full" in line and f"data_dir {mnt / 'data'}" in line, line
    assert ("kdn.lock" if free_pages == 0 else "lock.mdb") in line, line


def test_the_lock_file_is_allocated_whole(tmp_path: Path) -> None:
    """LMDB's reader table (``lock.mdb``, written through a map) has every block on disk once
    the tier opens: made sparse, a read transaction whose slot falls on a page never allocated
    is a SIGBUS once the filesystem is full."""
    tier = LmdbTier(tmp_path / "lmdb", capacity_bytes=1 << 20)
    try:
        st = os.stat(tmp_path / "lmdb" / "lock.mdb")
        assert st.st_size >= 512 * 64 and st.st_blocks * 512 >= st.st_size, st
    finally:
        tier.close()


def test_a_disk_write_that_raises_a_bug_is_a_refusal_not_the_new_value_behind_an_error(
        tmp_path: Path) -> None:
    """The disk tier raising what no tier should (a ValueError from inside its library) on a
    write-through DEFAULT store was the client's INTERNAL error, yet the RAM tier already held
    the new value and served it. It is the disk's refusal now: the store is acknowledged, the
    new value served; a DISK store, which the disk must acknowledge, fails naming the tier and
    leaves the previous value served."""
    cfg = ServerConfig(port=0, data_dir=tmp_path / "data", ram_bytes=64 << 20,
                       disk_bytes=64 << 20, shutdown_grace_s=1)
    store = build_store(cfg)
    disk, real = store.tiers[1], store.tiers[1].put
    broken = [False]

    def put(key: bytes, value: bytes, *, ttl_s: float | None = None) -> None:
        if broken[0]:
            raise ValueError("a bug inside the library")
        real(key, value, ttl_s=ttl_s)

    disk.put = put  # type: ignore[method-assign]
    lay = uniform_layout()
    key = keys.chunk_key(list(range(8)), lay)
    old, new, newer = (random_kv(lay, 8, seed=s) for s in (1, 2, 3))
    with ServerThread(cfg, store) as st, Client(st.address, timeout_s=10, shm_bytes=0) as c:
        c.store(key, old, mode="raw")
        broken[0] = True
        assert c.store(key, new, mode="raw").tier == "ram"
        back = c.retrieve(key, layout=lay)
        assert back is not None and back.equal(new)
        with pytest.raises(KDNError, match="disk tier failed unexpectedly: ValueError"):
            c.store(key, newer, mode="raw", options=StoreOptions(durability=Durability.DISK))
        back = c.retrieve(key, layout=lay)
        assert back is not None and back.equal(new)
