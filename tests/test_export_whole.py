"""An export is a whole backup or says it is not: a damaged copy is replaced by the next tier's
good one, an entry with no good copy anywhere fails the export (the file finished with the
others, exit 1), and a tier that does not answer refuses the export (UNAVAILABLE, no end
marker) rather than leaving out the entries only it holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kdn import keys
from kdn.cli.main import main as cli
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.exportfile import read_records, summary
from kdn.errors import Corrupt, Unavailable
from kdn.server import ServerConfig, ServerThread
from kdn.store.base import Tier
from tests.helpers import random_kv, uniform_layout
from tests.redis_servers import RedisServer

LAY = uniform_layout(layers=2, heads=2, dim=8)


def _tier(st: ServerThread, name: str) -> Tier:
    return next(t for t in st.server.store.tiers if t.name == name)


def _damage(tier: Tier, skey: bytes) -> None:
    bad = bytearray(tier.get(skey) or b"")
    bad[len(bad) // 2] ^= 0xFF
    tier.put(skey, bytes(bad))


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


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
            assert not summary(tmp_path / "backup.kdnx").ended  # never taken for whole
            redis.start()
            st.server.store.probe()  # back
            assert a.export_to(tmp_path / "backup.kdnx") == 4
        assert json.dumps(sorted(r.key.hex() for r in read_records(
            tmp_path / "backup.kdnx")[0])) == json.dumps(sorted(k.hex() for k in ks))
