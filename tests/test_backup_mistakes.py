"""Backups that say what went wrong: an import into a server that can not hold a record's
tenant rejects it, a rejected entry's reason reaches the operator, a finished file is not taken
for a new export, and a refused export leaves no file in the way of the corrected one."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.exportfile import (
    MAGIC,
    Filter,
    Record,
    encode_end,
    encode_filter,
    encode_record,
    read_records,
)
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout
from tests.test_export_file import _cli, _with_tenants

LAY = uniform_layout(layers=2, heads=2, dim=8)


def test_a_tenants_record_is_rejected_by_a_server_without_tenants(tmp_path: Path) -> None:
    """An admin's backup of a server with tenants, imported into one without (no auth file),
    was counted imported: its entries went to a key space no caller there has."""
    k, kv = keys.chunk_key([1, 2], LAY), random_kv(LAY, 8)
    with _with_tenants(tmp_path, "src") as src:
        with Client(src.address, api_key="key-a", shm_bytes=0) as c:
            c.store(k, kv)
        with AdminClient(src.address, api_key="key-ops") as ops:
            assert ops.export_to(tmp_path / "tenants.kdnx") == 1
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "plain")) as st:
        with AdminClient(st.address) as a:
            got = a.import_from(tmp_path / "tenants.kdnx")
            assert (got.imported, got.rejected) == (0, 1)
            assert list(a.ls()) == []
            a.store(k, kv)  # a record of no tenant goes in as before
            assert a.export_to(tmp_path / "plain.kdnx") == 1
    assert [r.tenant for r in read_records(tmp_path / "plain.kdnx")[0]] == [""]
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "plain2")) as st, \
            AdminClient(st.address) as a:
        got = a.import_from(tmp_path / "plain.kdnx")
        assert (got.imported, got.rejected) == (1, 0)
        assert a.retrieve(k).equal(kv)  # type: ignore[union-attr]


def test_a_rejected_entrys_reason_is_said(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          caplog: pytest.LogCaptureFixture) -> None:
    """Rejected entries were only counted ('rejected: 10', nothing on stderr nor in the
    server's log): the first few reasons come in the answer, printed on stderr, each is
    logged by the server."""
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a")) as st:
        with Client(st.address, shm_bytes=0) as c:
            k = keys.chunk_key([1], LAY)
            c.store(k, random_kv(LAY, 8))
            good = bytes(c.fetch(k).parts.to_bytes())  # type: ignore[union-attr]
        bad = good[:-8] + bytes(8)  # its last frame's bytes damaged
        recs = [Record("default", bytes([i + 1]) * 32, b"c%d" % i, bad) for i in range(10)]
        path = tmp_path / "damaged.kdnx"
        path.write_bytes(MAGIC + encode_filter(Filter()) + b"".join(map(encode_record, recs))
                         + encode_end(len(recs)))
        caplog.set_level(logging.WARNING, logger="kdn.server.admin")
        code, out, err = _cli(["admin", "import", str(path), "--address", st.address], capsys)
        assert code == 1 and out.split() == ["imported:", "0", "skipped:", "0", "rejected:",
                                             "10"], out
        lines = err.strip().splitlines()
        assert len(lines) == 9, err
        assert lines[0].startswith("kdn admin import: rejected key 0101010101010101 in "
                                   "'default': ") and "checksum" in lines[0]
        assert lines[-1] == "kdn admin import: 2 more rejected; the server's log says why"
        said = [r.getMessage() for r in caplog.records if "import: rejected" in r.getMessage()]
        assert len(said) == 10 and "0a0a0a0a0a0a0a0a" in said[-1]
        code, out, _ = _cli(["admin", "import", str(path), "--address", st.address,
                             "-o", "json"], capsys)
        got = json.loads(out)
        assert code == 1 and got["rejected"] == 10 and len(got["reasons"]) == 8


def test_an_export_into_a_finished_file_is_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A nightly `kdn admin export FILE` run on last night's finished FILE said 'entries: 1',
    exit 0, and kept the stale file: refused, one line, the file left as it is."""
    path = tmp_path / "nightly.kdnx"
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a")) as st:
        with Client(st.address, shm_bytes=0) as c:
            c.store(keys.chunk_key([1], LAY), random_kv(LAY, 8))
        argv = ["admin", "export", str(path), "--address", st.address]
        assert _cli(argv, capsys)[0] == 0
        before = path.read_bytes()
        with Client(st.address, shm_bytes=0) as c:
            c.store(keys.chunk_key([2], LAY), random_kv(LAY, 8, seed=2))
        code, out, err = _cli(argv, capsys)
        assert code == 1 and out == "" and err == (
            f"kdn admin export: {path} holds a finished export (1 entries), left as it is; "
            "export into a new file\n")
        assert path.read_bytes() == before
        assert _cli(["admin", "export", str(tmp_path / "new.kdnx"), *argv[3:]], capsys)[0] == 0
    assert len(read_records(tmp_path / "new.kdnx")[0]) == 2


def test_a_refused_export_leaves_no_file_in_the_way(tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """An export the server refused outright left FILE holding a header of the refused
    filters, and the corrected command into it was refused ('is an export of ..., tenant
    'team-b''): the file it made is removed, an empty one it began emptied again."""
    path, empty = tmp_path / "mine.kdnx", tmp_path / "empty.kdnx"
    empty.touch()
    with _with_tenants(tmp_path, "src") as st:
        with Client(st.address, api_key="key-a", shm_bytes=0) as c:
            c.store(keys.chunk_key([1], LAY), random_kv(LAY, 8))
        a = ["--address", st.address, "--api-key", "key-a"]
        for p in (path, empty):
            code, _, err = _cli(["admin", "export", str(p), "--tenant", "team-b", *a], capsys)
            assert code == 1 and "can not reach tenant 'team-b'" in err, err
        assert not path.exists() and empty.read_bytes() == b""
        for p in (path, empty):
            assert _cli(["admin", "export", str(p), *a], capsys)[0] == 0
            assert [r.tenant for r in read_records(p)[0]] == ["team-a"]


def test_an_entry_refused_at_its_last_piece_is_counted_once(tmp_path: Path) -> None:
    """A value refused at its last piece (more than the server may be receiving) kept its
    pieces, and was counted rejected again as abandoned when the next entry began."""
    import grpc

    from kdn.v1 import kdn_pb2 as pb
    from kdn.v1 import kdn_pb2_grpc as pb_grpc

    k1, k2 = keys.chunk_key([1], LAY), keys.chunk_key([2], LAY)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0, ram_bytes=1 << 20,
                       max_entry_bytes=1 << 20)
    with ServerThread(cfg) as st:
        with Client(st.address, shm_bytes=0) as c:
            c.store(k2, random_kv(LAY, 8))
            whole = bytes(c.fetch(k2).parts.to_bytes())  # type: ignore[union-attr]
            c.delete(k2)
        half = bytes(600 << 10)  # two: more than the server may be receiving (1 MiB)
        items = [pb.ImportItem(namespace="default", key=k1, value=half, offset=0, more=True),
                 pb.ImportItem(namespace="default", key=k1, value=half, offset=len(half)),
                 pb.ImportItem(namespace="default", key=k2, value=whole)]
        with grpc.insecure_channel(st.address) as ch:
            got = pb_grpc.KDNAdminStub(ch).Import(iter(items), timeout=30)
    assert (got.imported, got.rejected) == (1, 1), got
    assert len(got.reasons) == 1 and "the server is receiving" in got.reasons[0]
