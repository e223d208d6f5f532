"""An export is a whole backup or says it is not: a damaged copy is replaced by the next tier's
good one, an entry with no good copy anywhere fails the export (the file finished with the
others, exit 1), a tier that does not answer refuses the export (UNAVAILABLE, no end marker)
rather than leaving out the entries only it holds, and a file is resumed only from the server
that began it. A restored entry keeps its time to live and its pin."""

from __future__ import annotations

import json
import time
from dataclasses import replace
from pathlib import Path

import grpc
import pytest

from kdn import StoreOptions, codec, keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.exportfile import (
    MAGIC,
    Filter,
    encode_end,
    encode_filter,
    encode_record,
    read_records,
    summary,
)
from kdn.errors import Corrupt, InvalidArgument, Unavailable
from kdn.options import MAX_TTL_S
from kdn.server import ServerConfig, ServerThread
from kdn.store.base import Tier
from kdn.transport.wire import frame_message
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv, uniform_layout
from tests.redis_servers import RedisServer
from tests.test_export_file import _cli

LAY = uniform_layout(layers=2, heads=2, dim=8)


def _tier(st: ServerThread, name: str) -> Tier:
    return next(t for t in st.server.store.tiers if t.name == name)


def _damage(tier: Tier, skey: bytes) -> None:
    bad = bytearray(tier.get(skey) or b"")
    bad[len(bad) // 2] ^= 0xFF
    tier.put(skey, bytes(bad))


def test_a_damaged_copy_is_exported_from_the_next_tier_and_none_good_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "data")) as st:
        ks = [keys.chunk_key([i, 9], LAY) for i in range(3)]
        with Client(st.address, shm_bytes=0) as c:
            for i, k in enumerate(ks):
                c.store(k, random_kv(LAY, 8, seed=i))
        st.server.store.flush()
        skeys = [keys.store_key("", "default", k) for k in ks]
        _damage(_tier(st, "ram"), skeys[0])  # the disk copy is good
        with AdminClient(st.address) as a:
            assert a.export_to(tmp_path / "one.kdnx") == 3
        assert ks[0] in {r.key for r in read_records(tmp_path / "one.kdnx")[0]}

        _damage(_tier(st, "disk"), skeys[1])  # and no tier holds a good copy of this one
        _damage(_tier(st, "ram"), skeys[1])
        with AdminClient(st.address) as a, pytest.raises(Corrupt, match="1 entries were left"):
            a.export_to(tmp_path / "two.kdnx")
        assert summary(tmp_path / "two.kdnx").ended  # the others: a finished file
        assert {r.key for r in read_records(tmp_path / "two.kdnx")[0]} == {ks[0], ks[2]}
        code, out, err = _cli(["admin", "export", str(tmp_path / "three.kdnx"),
                               "--address", st.address, "-o", "json"], capsys)
        assert code == 1 and "1 entries were left out" in err, (out, err)


def test_an_export_while_a_tier_is_down_is_refused(tmp_path: Path) -> None:
    with RedisServer(tmp_path / "redis") as redis, ServerThread(ServerConfig(
            port=0, data_dir=tmp_path / "n", disk_bytes=0, redis_url=redis.url,
            tier_order=("ram", "redis"))) as st:
        ks = [keys.chunk_key([i], LAY) for i in range(4)]
        with Client(st.address, shm_bytes=0) as c:
            for i, k in enumerate(ks):
                c.store(k, random_kv(LAY, 8, seed=i))
        st.server.store.flush()
        with AdminClient(st.address) as a:
            a.evict(ks[:2], "default", "ram")  # these two live in Redis only
            redis.kill()
            with pytest.raises(Unavailable, match="tier redis does not answer"):
                a.export_to(tmp_path / "backup.kdnx")
            assert not (tmp_path / "backup.kdnx").exists()  # refused at once: no file
            redis.start()
            st.server.store.probe()  # back
            assert a.export_to(tmp_path / "backup.kdnx") == 4
        assert json.dumps(sorted(r.key.hex() for r in read_records(
            tmp_path / "backup.kdnx")[0])) == json.dumps(sorted(k.hex() for k in ks))


def test_an_export_resumes_only_from_the_server_that_began_it(tmp_path: Path) -> None:
    path = tmp_path / "a.kdnx"
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a")) as a, \
            ServerThread(ServerConfig(port=0, data_dir=tmp_path / "b")) as b:
        for st, seed in ((a, 100), (b, 200)):
            with Client(st.address, shm_bytes=0) as c:
                for i in range(4):
                    c.store(keys.chunk_key([seed + i], LAY), random_kv(LAY, 8, seed=seed + i))
        with AdminClient(a.address) as ca:
            ca.export_to(path)
        whole = path.read_bytes()
        path.write_bytes(whole[:len(whole) // 2])  # interrupted
        with AdminClient(b.address) as cb:
            for content in (whole[:len(whole) // 2], whole):  # unfinished, finished
                path.write_bytes(content)
                with pytest.raises(InvalidArgument, match=f"server at '{a.address}', not"):
                    cb.export_to(path)
                assert path.read_bytes() == content  # untouched
        with AdminClient(a.address) as ca:  # its own server resumes it
            path.write_bytes(whole[:len(whole) // 2])
            assert ca.export_to(path) == 4
        assert path.read_bytes() == whole


def test_a_restored_entry_keeps_its_time_to_live_and_pin(tmp_path: Path) -> None:
    ks = [keys.chunk_key([i, 5], LAY) for i in range(3)]
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "src")) as src:
        with Client(src.address, shm_bytes=0) as c:
            c.store(ks[0], random_kv(LAY, 8, seed=0), options=StoreOptions(ttl_s=60))
            c.store(ks[1], random_kv(LAY, 8, seed=1), options=StoreOptions(pin=True))
            c.store(ks[2], random_kv(LAY, 8, seed=2), options=StoreOptions(ttl_s=60))
        with AdminClient(src.address) as a:
            a.export_to(tmp_path / "backup.kdnx")
    recs = {r.key: r for r in read_records(tmp_path / "backup.kdnx")[0]}
    assert 55 < recs[ks[0]].expires_at - time.time() <= 60 and not recs[ks[0]].pinned
    assert recs[ks[1]].expires_at == 0 and recs[ks[1]].pinned
    # the third expired since the export (a file written then: its expiry in the past)
    old = [r if r.key != ks[2] else replace(r, expires_at=time.time() - 1)
           for r in recs.values()]
    (tmp_path / "old.kdnx").write_bytes(MAGIC + encode_filter(summary(
        tmp_path / "backup.kdnx").filter or Filter(), source="src")
        + b"".join(encode_record(r) for r in old) + encode_end(len(old)))
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "dst")) as dst:
        with AdminClient(dst.address) as a:
            resp = a.import_from(tmp_path / "old.kdnx")
            assert (resp.imported, resp.skipped, resp.rejected) == (2, 1, 0)
            assert a.inspect(ks[1]).pinned and not a.inspect(ks[0]).pinned
        ram = _tier(dst, "ram")
        left = ram.ttl_remaining(keys.store_key("", "default", ks[0]))
        assert left is not None and 50 < left <= 60
        assert ram.ttl_remaining(keys.store_key("", "default", ks[1])) is None
        with Client(dst.address, shm_bytes=0) as c:
            assert c.retrieve(ks[2]) is None
        with grpc.insecure_channel(dst.address) as ch:  # a time to live no store could have
            got = pb_grpc.KDNAdminStub(ch).Import(iter([pb.ImportItem(
                namespace="default", key=ks[2], value=recs[ks[2]].value, ttl_seconds=ttl)
                for ttl in (-1.0, float("nan"))]), timeout=30)
        assert (got.imported, got.rejected) == (0, 2)


def test_a_time_to_live_past_the_longest_is_cut_to_it_on_store_export_and_import(
        tmp_path: Path) -> None:
    """StoreOptions took up to 2**64 - 1 s, but an export of 2**62 s died in struct.error (and
    every resume on the same entry) and an import of 10**16 s was refused: one longest time to
    live, MAX_TTL_S, which each path cuts a longer one to."""
    ks = [keys.chunk_key([i, 6], LAY) for i in range(3)]
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "src")) as src:
        with Client(src.address, shm_bytes=0) as c:
            c.store(ks[0], random_kv(LAY, 8, seed=0), options=StoreOptions(ttl_s=2**62))
        parts = codec.encode_parts(random_kv(LAY, 8, seed=1), "raw", layers_per_frame=1)
        head = pb.StoreRequest(header=pb.StoreHeader(  # another client's: any uint64
            namespace="default", key=ks[1], container_header=parts.header,
            total_bytes=len(parts.header) + sum(len(f) for f in parts.frames),
            options=pb.StoreOptions(ttl_seconds=2**64 - 1)))
        with grpc.insecure_channel(src.address) as ch:
            pb_grpc.KDNStub(ch).Store(iter([head, *(
                pb.StoreRequest.FromString(frame_message(i, f))
                for i, f in enumerate(parts.frames))]), timeout=30)
        ram = _tier(src, "ram")  # an entry stored before kdn cut them
        src.server.store.put(keys.store_key("", "default", ks[2]),
                             ram.get(keys.store_key("", "default", ks[0])) or b"", ttl_s=1e17)
        for k in ks[:2]:
            left = ram.ttl_remaining(keys.store_key("", "default", k))
            assert left is not None and MAX_TTL_S - 60 < left <= MAX_TTL_S
        with AdminClient(src.address) as a:
            assert a.export_to(tmp_path / "b.kdnx") == 3
    for r in read_records(tmp_path / "b.kdnx")[0]:
        assert MAX_TTL_S - 60 < r.expires_at - time.time() <= MAX_TTL_S
    far = [replace(r, expires_at=1.8e16) for r in read_records(tmp_path / "b.kdnx")[0]]
    (tmp_path / "far.kdnx").write_bytes(MAGIC + encode_filter(Filter(), source="src")
                                        + b"".join(encode_record(r) for r in far)
                                        + encode_end(len(far)))  # the most a file can say
    for name in ("b.kdnx", "far.kdnx"):
        with ServerThread(ServerConfig(port=0, data_dir=tmp_path / f"dst-{name}")) as dst:
            with AdminClient(dst.address) as a:
                resp = a.import_from(tmp_path / name)
                assert (resp.imported, resp.rejected) == (3, 0)
            for k in ks:
                left = _tier(dst, "ram").ttl_remaining(keys.store_key("", "default", k))
                assert left is not None and MAX_TTL_S - 60 < left <= MAX_TTL_S


def test_a_verify_while_a_tier_is_down_verifies_the_others_and_says_so(tmp_path: Path) -> None:
    """Redis down: verify checks the RAM and disk tiers (their damaged copies removed) and
    then fails as Unavailable naming redis (it failed UNKNOWN with TierUnavailable's class,
    and the tiers after redis were never verified)."""
    with RedisServer(tmp_path / "redis") as redis, ServerThread(ServerConfig(
            port=0, data_dir=tmp_path / "n", redis_url=redis.url,
            tier_order=("ram", "redis", "disk"))) as st:
        ks = [keys.chunk_key([i], LAY) for i in range(3)]
        with Client(st.address, shm_bytes=0) as c:
            for i, k in enumerate(ks):
                c.store(k, random_kv(LAY, 8, seed=i))
        st.server.store.flush()
        skeys = [keys.store_key("", "default", k) for k in ks]
        ram, disk = _tier(st, "ram"), _tier(st, "disk")
        _damage(ram, skeys[0])
        _damage(disk, skeys[1])
        redis.kill()
        with AdminClient(st.address) as a, pytest.raises(
                Unavailable, match="tier redis does not answer: not verified"):
            a.verify()
        assert ram.get(skeys[0]) is None and disk.get(skeys[1]) is None  # verified: removed
        assert ram.get(skeys[2]) is not None and disk.get(skeys[2]) is not None
