"""Backups that can not silently be wrong: ``kdn admin export`` records its filters and resumes
only the export it wrote, ``import`` refuses a cut-off, foreign or damaged file (exit 1, nothing
sent), and both stream the file one record at a time."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import traceback
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kdn import keys
from kdn.cli.main import main as cli
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.exportfile import (
    MAGIC_V1,
    MAGIC_V2,
    MAGIC_V3,
    ExportWriter,
    Filter,
    Record,
    encode_end,
    encode_filter,
    encode_record,
    read_records,
    scan,
    summary,
)
from kdn.errors import Corrupt, InvalidArgument, PermissionDenied
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout

LAY = uniform_layout(layers=2, heads=2, dim=8)
NAMESPACES = {"rag": 3, "kb": 4, "sglang": 2}


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "data")) as st:
        with Client(st.address) as c:
            for ns, n in NAMESPACES.items():
                for i in range(n):
                    c.store(keys.chunk_key([i, len(ns)], LAY), random_kv(LAY, 8, seed=i),
                            namespace=ns)
        yield st


def _cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = cli(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_export_resumes_only_with_its_own_filters(server: ServerThread, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    a = ["--address", server.address, "-o", "json"]
    mixed = tmp_path / "mixed.kdnx"
    code, out, _ = _cli(["admin", "export", str(mixed), *a], capsys)
    assert code == 0 and json.loads(out)["entries"] == sum(NAMESPACES.values())
    assert mixed.stat().st_mode & 0o777 == 0o600  # every tenant's entries: its writer's alone
    # the case: another filter into that file was "resumed" with every namespace
    before = mixed.read_bytes()
    code, out, err = _cli(["admin", "export", str(mixed), "--namespace", "rag", *a], capsys)
    assert code == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "is an export of every namespace, not of 'rag'" in err
    assert mixed.read_bytes() == before  # untouched
    rag = tmp_path / "rag.kdnx"
    code, out, _ = _cli(["admin", "export", str(rag), "--namespace", "rag", *a], capsys)
    assert code == 0 and json.loads(out)["entries"] == NAMESPACES["rag"]
    assert {r.namespace for r in read_records(rag)[0]} == {"rag"}
    code, _, err = _cli(["admin", "export", str(rag), *a], capsys)  # the other way round too
    assert code == 1 and "is an export of 'rag', not of every namespace" in err


def test_an_interrupted_export_resumes_where_it_stopped(server: ServerThread,
                                                        tmp_path: Path) -> None:
    path = tmp_path / "kb.kdnx"
    with AdminClient(server.address) as c:
        assert c.export_to(path, "kb") == NAMESPACES["kb"]
        whole = read_records(path)[0]
        # cut inside the last record: three complete records and a torn one, no end marker
        s = summary(path)
        assert s.ended and s.records == 4
        cut = len(path.read_bytes()) - 18 - len(encode_record(whole[-1])) // 2
        path.write_bytes(path.read_bytes()[:cut])
        s = summary(path)
        assert (s.records, s.torn, s.ended) == (3, True, False)
        assert c.export_to(path, "kb") == NAMESPACES["kb"]  # resumed, not duplicated
        again = read_records(path)[0]
        assert [(r.key, r.value) for r in again] == [(r.key, r.value) for r in whole]
        assert summary(path).ended
        # a finished export run again is refused, left as it is (a snapshot; it said it was
        # exported, stale; new ones: a new file)
        finished = path.read_bytes()
        c.store(keys.chunk_key([77], LAY), random_kv(LAY, 8), namespace="kb")
        with pytest.raises(InvalidArgument, match=r"holds a finished export \(4 entries\), "
                                                  "left as it is; export into a new file"):
            c.export_to(path, "kb")
        assert path.read_bytes() == finished


def test_import_refuses_a_cut_off_foreign_or_damaged_file(
        server: ServerThread, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    full = tmp_path / "all.kdnx"
    with AdminClient(server.address) as c:
        c.export_to(full)
    data = full.read_bytes()
    mid = len(data) // 2  # inside a value
    fresh = tmp_path / "fresh"
    with ServerThread(ServerConfig(port=0, data_dir=fresh)) as target:
        a = ["--address", target.address]
        cases = {
            "half": (data[: len(data) // 2], "is cut off inside record"),
            "on a record boundary": (data[: summary(full).good - len(encode_record(
                read_records(full)[0][-1]))], "without its end marker"),
            "no end marker": (data[:-18], "without its end marker"),
            "foreign": (b"PK\x03\x04 a zip file, not an export", "is not a kdn export file"),
            "empty": (b"", "is not a kdn export file"),
            "flipped byte": (data[:mid] + bytes([data[mid] ^ 1]) + data[mid + 1:], "checksum"),
        }
        for name, (content, words) in cases.items():
            bad = tmp_path / f"{name}.kdnx"
            bad.write_bytes(content)
            code, out, err = _cli(["admin", "import", str(bad), *a], capsys)
            assert code == 1, (name, err)
            assert words in err and len(err.strip().splitlines()) == 1, (name, err)
            assert "Traceback" not in err and out == ""
            with AdminClient(target.address) as t:
                assert list(t.ls()) == [], name  # nothing was sent
        code, out, err = _cli(["admin", "import", str(full), *a, "-o", "json"], capsys)
        assert code == 0, err
        assert json.loads(out) == {"imported": sum(NAMESPACES.values()), "skipped": 0,
                                   "rejected": 0, "reasons": []}


def test_format_1_2_and_3_files_still_import(server: ServerThread, tmp_path: Path) -> None:
    with AdminClient(server.address) as c:
        c.export_to(tmp_path / "new.kdnx", "kb")
        new = read_records(tmp_path / "new.kdnx")[0]
        v1, v2, v3 = tmp_path / "v1.kdnx", tmp_path / "v2.kdnx", tmp_path / "v3.kdnx"
        v1.write_bytes(MAGIC_V1 + b"".join(encode_record(r, 1) for r in new))
        v2.write_bytes(MAGIC_V2 + encode_filter(Filter("kb"), 2)
                       + b"".join(encode_record(r, 2) for r in new) + encode_end(len(new)))
        v3.write_bytes(MAGIC_V3 + encode_filter(Filter("kb"), 3)
                       + b"".join(encode_record(r, 3) for r in new) + encode_end(len(new)))
        for old, version in ((v1, 1), (v2, 2), (v3, 3)):
            assert [(r.key, r.value, r.tenant) for r in read_records(old)[0]] == \
                [(r.key, r.value, "") for r in new]
            assert c.import_from(old).skipped == NAMESPACES["kb"]
            with pytest.raises(InvalidArgument, match=f"older kdn \\(format {version}\\)"):
                c.export_to(old, "kb")  # another format: no resume


def test_an_export_file_is_private_whatever_was_there_before(tmp_path: Path) -> None:
    touched = tmp_path / "touched.kdnx"  # an empty file made by hand (umask 022)
    touched.touch(mode=0o644)
    touched.chmod(0o644)
    out = ExportWriter.open(touched, Filter())
    out.write(Record("kb", b"k" * 32, b"c", b"v"))
    out.close()
    assert touched.stat().st_mode & 0o777 == 0o600
    touched.chmod(0o644)  # an unfinished one made readable since: private again on resuming
    ExportWriter.open(touched, Filter()).close()
    assert touched.stat().st_mode & 0o777 == 0o600


def test_a_second_export_into_a_file_being_written_is_refused(tmp_path: Path) -> None:
    """Two exports into one file at once (a run still going, overlapping crons) each wrote at
    its own offset, both reported success, and import refused the file: the second is refused
    while the first holds the file, and resumes it once that one is closed."""
    path = tmp_path / "backup.kdnx"
    first = ExportWriter.open(path, Filter())
    first.write(Record("kb", b"k" * 32, b"c1", b"v"))
    with pytest.raises(InvalidArgument, match=f"another export is writing {path}"):
        ExportWriter.open(path, Filter())
    first.close()
    second = ExportWriter.open(path, Filter())
    assert (second.records, second.after) == (1, b"c1")
    second.finish()
    second.close()
    assert [r.cursor for _, r in scan(path)] == [b"c1"]


def test_an_export_goes_into_no_other_users_file(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """A file another user made first (empty, or an unfinished export it crafted; or a link to
    one) stays that user's to read whatever mode kdn gives it: refused before anything is
    written or cut off. A link to nothing makes nothing."""
    unfinished = tmp_path / "unfinished.kdnx"
    out = ExportWriter.open(unfinished, Filter("kb"))
    out.write(Record("kb", b"k" * 32, b"c", b"v"))
    out.close()
    empty = tmp_path / "empty.kdnx"
    empty.touch(mode=0o644)
    before = {p: p.read_bytes() for p in (unfinished, empty)}
    link = tmp_path / "link.kdnx"
    link.symlink_to(empty)
    someone_else = os.geteuid() + 1
    with monkeypatch.context() as m:
        m.setattr("kdn.client.exportfile.os.geteuid", lambda: someone_else)
        for path in (unfinished, empty, link):
            with pytest.raises(InvalidArgument, match="not by this user.*export into a new"):
                ExportWriter.open(path, Filter("kb"))
    dangling = tmp_path / "dangling.kdnx"
    dangling.symlink_to(tmp_path / "elsewhere.kdnx")
    with pytest.raises(InvalidArgument, match="is a link to nothing"):
        ExportWriter.open(dangling, Filter("kb"))
    assert {p: p.read_bytes() for p in before} == before
    assert empty.stat().st_mode & 0o777 == 0o644
    assert not (tmp_path / "elsewhere.kdnx").exists()


def _as_an_ordinary_user(fn: Any) -> None:
    """``fn()``, in a child as uid 65534 where this is root (whose writes no mode denies)."""
    if os.geteuid() != 0:
        fn()
        return
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_finished_read_only_export_is_left_as_it_is() -> None:
    """An export file its user made read-only (0444) to keep it was a raw PermissionError on
    a second run (the file was opened to write first): a finished one is complete, one that
    must be written is refused, nothing changed."""
    folder = Path(tempfile.mkdtemp())
    folder.chmod(0o777)

    def run() -> None:
        finished, unfinished, empty = (folder / f"{n}.kdnx" for n in ("f", "u", "e"))
        for path in (finished, unfinished):
            out = ExportWriter.open(path, Filter("kb"))
            out.write(Record("kb", b"k" * 32, b"c", b"v"))
            if path == finished:
                out.finish()
            out.close()
        empty.touch()
        before = {p: p.read_bytes() for p in (finished, unfinished, empty)}
        for path in before:
            path.chmod(0o444)
        again = ExportWriter.open(finished, Filter("kb"))
        assert again.complete and again.records == 1
        for path in (unfinished, empty):
            with pytest.raises(InvalidArgument, match="read-only and holds no finished"):
                ExportWriter.open(path, Filter("kb"))
        assert {p: p.read_bytes() for p in before} == before

    try:
        _as_an_ordinary_user(run)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_file_is_read_one_record_at_a_time(tmp_path: Path) -> None:
    """Import's two passes and a resume's scan hold one record, not the file (the old reader
    took the whole file into memory)."""
    path = tmp_path / "big.kdnx"
    value = bytes(range(256)) * 4096  # 1 MiB
    out = ExportWriter.open(path, Filter("kb"))
    for i in range(24):
        out.write(Record("kb", i.to_bytes(32, "big"), i.to_bytes(4, "big"), value))
    out.finish()
    out.close()
    assert path.stat().st_size > 24 << 20
    tracemalloc.start()
    try:
        n = sum(1 for _ in scan(path))
        s = summary(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert n == s.records == 24 and s.ended
    assert peak < 4 << 20, f"peak {peak} bytes for a {path.stat().st_size}-byte file"
    path.write_bytes(path.read_bytes()[:-18])  # as if interrupted after the last record
    resumed = ExportWriter.open(path, Filter("kb"))  # resumes after the last record
    assert (resumed.records, resumed.after) == (24, (23).to_bytes(4, "big"))
    resumed.close()
    with pytest.raises(Corrupt, match="without its end marker"):
        list(scan(path))


def test_a_record_declaring_more_than_the_file_holds_is_not_read(tmp_path: Path) -> None:
    """A crafted record's lengths are checked against the bytes left in the file before any
    is read: a 1 TiB value in a 100-byte file is a cut-off file, not an allocation."""
    import struct

    from kdn.client.exportfile import MAGIC

    h, q = struct.Struct("<H"), struct.Struct("<Q")
    for declared in (1 << 40, 64 << 30, 100):
        body = h.pack(0) + h.pack(7) + b"default" + h.pack(32) + bytes(32) + h.pack(0) + \
            q.pack(declared)
        path = tmp_path / f"lying-{declared}.kdnx"
        path.write_bytes(MAGIC + encode_filter(Filter()) + body + b"x" * 16)
        tracemalloc.start()
        try:
            with pytest.raises(Corrupt, match="is cut off inside record 0"):
                list(scan(path))
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 1 << 20, (declared, peak)


def test_import_admits_entries_as_a_store_does(server: ServerThread, tmp_path: Path) -> None:
    """An import goes through the one write path: an entry a Store would refuse here (too
    large, a model not served) is rejected, and counted, while the rest go in."""
    big_lay = uniform_layout(layers=2, heads=2, dim=64)
    with Client(server.address) as c:
        c.store(keys.chunk_key([99], big_lay), random_kv(big_lay, 64, seed=1), namespace="kb")
    with AdminClient(server.address) as c:
        c.export_to(tmp_path / "kb.kdnx", "kb")
    small = NAMESPACES["kb"]
    cfg = ServerConfig(port=0, data_dir=tmp_path / "small", max_entry_bytes=4096)
    with ServerThread(cfg) as target, AdminClient(target.address) as t:
        got = t.import_from(tmp_path / "kb.kdnx")
        assert (got.imported, got.rejected) == (small, 1)
        assert len(list(t.ls())) == small
    only = "0" * 32
    cfg = ServerConfig(port=0, data_dir=tmp_path / "strict", allowed_models=(only,))
    with ServerThread(cfg) as target, AdminClient(target.address) as t:
        got = t.import_from(tmp_path / "kb.kdnx")
        assert (got.imported, got.rejected) == (0, small + 1)
        assert list(t.ls()) == []


TENANTS = """
tenants:
  team-a: {api_keys: ["key-a"]}
  team-b: {api_keys: ["key-b"]%s}
  ops: {api_keys: ["key-ops"], role: admin}
"""
KEYS = {"team-a": "key-a", "team-b": "key-b"}


def _with_tenants(tmp_path: Path, name: str, team_b: str = "") -> ServerThread:
    """A server of two tenants and an admin (``team_b``: more of team-b's settings)."""
    auth = tmp_path / f"{name}.yaml"
    auth.write_text(TENANTS % team_b)
    auth.chmod(0o600)
    return ServerThread(ServerConfig(port=0, data_dir=tmp_path / name, auth_file=str(auth)))


def _tenants(c: AdminClient) -> list[tuple[str, bytes]]:
    return sorted((e.tenant, e.key) for e in c.ls())


def test_an_admins_backup_restores_every_tenant(tmp_path: Path) -> None:
    """Records carry their tenant: an admin's backup of a server with tenants comes back as it
    was (the same key of two tenants stays two entries, each charged to its tenant); a tenant's
    import takes its own records and rejects the others'."""
    same, other = keys.chunk_key([7, 7], LAY), keys.chunk_key([8], LAY)
    kvs = {t: random_kv(LAY, 8, seed=i) for i, t in enumerate(KEYS)}
    backup = tmp_path / "all.kdnx"
    with _with_tenants(tmp_path, "src") as src:
        for t, api_key in KEYS.items():
            with Client(src.address, api_key=api_key) as c:
                c.store(same, kvs[t])
        with Client(src.address, api_key="key-b") as c:
            c.store(other, kvs["team-a"])
        with AdminClient(src.address, api_key="key-ops") as ops:
            assert ops.export_to(backup) == 3
            listed = _tenants(ops)
            assert ops.export_to(tmp_path / "b.kdnx", tenant="team-b") == 2
        with AdminClient(src.address, api_key="key-a") as a, pytest.raises(PermissionDenied):
            a.export_to(tmp_path / "not-a.kdnx", tenant="team-b")
    assert sorted((r.tenant, r.key) for r in read_records(backup)[0]) == listed
    assert {r.tenant for r in read_records(tmp_path / "b.kdnx")[0]} == {"team-b"}
    with _with_tenants(tmp_path, "dst") as dst:
        with AdminClient(dst.address, api_key="key-ops") as ops:
            got = ops.import_from(backup)
            assert (got.imported, got.rejected) == (3, 0)
            assert _tenants(ops) == listed
            assert {t.tenant: t.entries for t in ops.stats().tenants} == {"team-a": 1,
                                                                           "team-b": 2}
        for t, api_key in KEYS.items():
            with Client(dst.address, api_key=api_key) as c:
                assert c.retrieve(same).equal(kvs[t])  # type: ignore[union-attr]
    with _with_tenants(tmp_path, "own") as own:
        with AdminClient(own.address, api_key="key-a") as a:
            got = a.import_from(backup)
            assert (got.imported, got.rejected) == (1, 2)  # team-b's are not team-a's to load
        with AdminClient(own.address, api_key="key-ops") as ops:
            assert _tenants(ops) == [("team-a", same)]


def test_an_admins_import_charges_each_entrys_tenant(tmp_path: Path) -> None:
    """Restored entries count against their tenant's quota, not the admin's."""
    backup = tmp_path / "all.kdnx"
    with _with_tenants(tmp_path, "src") as src:
        for i, api_key in enumerate(KEYS.values()):
            with Client(src.address, api_key=api_key) as c:
                c.store(keys.chunk_key([i], LAY), random_kv(LAY, 8, seed=i))
        with AdminClient(src.address, api_key="key-ops") as ops:
            ops.export_to(backup)
    with _with_tenants(tmp_path, "dst", ", quota_bytes: 512") as dst, \
            AdminClient(dst.address, api_key="key-ops") as ops:
        got = ops.import_from(backup)
        assert (got.imported, got.rejected) == (1, 1)  # team-b's entry is past its quota
        assert [t for t, _ in _tenants(ops)] == ["team-a"]


def test_an_entry_larger_than_a_message_is_exported_and_imported_in_pieces(
        tmp_path: Path) -> None:
    """A 4 MiB entry (stored frame by frame) through servers and clients whose messages are
    at most 1 MiB: its value travels in pieces both ways and arrives whole."""
    lay = uniform_layout(layers=4, heads=4, dim=64)
    key, kv = keys.chunk_key([1], lay), random_kv(lay, 1024)  # 1 MiB a layer
    small = {"max_message_bytes": 1 << 20}
    path = tmp_path / "big.kdnx"
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a", **small)) as src, \
            AdminClient(src.address, **small) as c:  # type: ignore[arg-type]
        c.store(key, kv, mode="raw")
        stored = c.fetch(key).parts.to_bytes()  # type: ignore[union-attr]
        assert len(stored) > 4 << 20
        assert c.export_to(path) == 1
    assert [r.value for r in read_records(path)[0]] == [stored]
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "b", **small)) as dst, \
            AdminClient(dst.address, **small) as c:  # type: ignore[arg-type]
        got = c.import_from(path)
        assert (got.imported, got.rejected) == (1, 0)
        assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_pieces_join_per_entry_and_a_broken_one_is_counted_once() -> None:
    """A value's pieces continue only the value of the same names; a new value (offset 0)
    after an unfinished one abandons it (counted), and is itself joined whole."""
    from kdn.transport.pieces import Pieces
    from kdn.v1 import kdn_pb2 as pb

    def item(key: bytes, at: int, value: bytes, more: bool) -> pb.ImportItem:
        return pb.ImportItem(namespace="kb", key=key, offset=at, value=value, more=more)

    a, b = bytes(32), b"\x01" * 32
    p = Pieces()
    assert p.add(item(a, 0, b"aaaa", True)) is None
    assert p.add(item(b, 0, b"whole", False)) == b"whole"  # a's last piece never came
    assert p.abandoned == 1
    assert p.add(item(a, 0, b"aa", True)) is None
    with pytest.raises(InvalidArgument, match=r"does not continue the value being joined "
                                               r"\(2 bytes in\)"):
        p.add(item(b, 2, b"bb", False))  # another entry's piece
    assert p.add(item(a, 0, b"x", True)) is None and p.add(item(a, 1, b"y", False)) == b"xy"
    assert not p.end() and p.abandoned == 1
    assert p.add(item(b, 0, b"half", True)) is None
    assert p.end() and p.abandoned == 2  # the stream ended inside b


def test_an_import_that_ends_inside_a_value_counts_it_rejected(tmp_path: Path) -> None:
    """An Import stream whose last value never got its last piece: that value is rejected
    (it was in neither count), the whole one before it imported."""
    import grpc

    from kdn.v1 import kdn_pb2 as pb
    from kdn.v1 import kdn_pb2_grpc as pb_grpc

    lay = uniform_layout(layers=2, heads=2, dim=8)
    kv = random_kv(lay, 4)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0)) as st:
        with Client(st.address) as c:
            c.store(keys.chunk_key([1], lay), kv, mode="raw")
            whole = c.fetch(keys.chunk_key([1], lay)).parts.to_bytes()  # type: ignore[union-attr]
            c.delete(keys.chunk_key([1], lay))
        items = [pb.ImportItem(namespace="default", key=keys.chunk_key([1], lay), value=whole),
                 pb.ImportItem(namespace="default", key=keys.chunk_key([2], lay),
                               value=whole[:10], more=True)]
        with grpc.insecure_channel(st.address) as ch:
            got = pb_grpc.KDNAdminStub(ch).Import(iter(items), timeout=30)
        assert (got.imported, got.rejected) == (1, 1)


def test_an_old_client_gets_whole_values_and_imports_fit_a_smaller_server(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Export cuts values in pieces only for a caller that says its limit (piece_bytes): an
    older client would write each piece as a record. Import cuts large values small enough
    for a server whose messages are smaller than the client's."""
    import grpc

    from kdn.client import admin
    from kdn.v1 import kdn_pb2 as pb

    lay = uniform_layout(layers=4, heads=4, dim=64)
    key, kv = keys.chunk_key([1], lay), random_kv(lay, 1024)  # an entry over 4 MiB
    small = {"max_message_bytes": 1 << 20}
    path = tmp_path / "big.kdnx"
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "a", **small)) as src:
        with AdminClient(src.address, **small) as c:  # type: ignore[arg-type]
            c.store(key, kv, mode="raw")
            c.export_to(path)
        with grpc.insecure_channel(src.address) as ch:
            export = ch.unary_stream("/kdn.v1.KDNAdmin/Export",
                                     request_serializer=pb.ExportRequest.SerializeToString,
                                     response_deserializer=pb.ExportItem.FromString)
            with pytest.raises(grpc.RpcError) as info:  # whole, as before: too large here
                list(export(pb.ExportRequest(), timeout=30))
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    monkeypatch.setattr(admin, "IMPORT_PIECE_BYTES", 512 << 10)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "b", **small)) as dst, \
            AdminClient(dst.address) as c:  # the client's own limit: the default 256 MiB
        got = c.import_from(path)
        assert (got.imported, got.rejected) == (1, 0)
        assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]


def test_a_value_refused_inside_its_pieces_is_counted_once(tmp_path: Path) -> None:
    """A value past what the server receives at once, refused at one of its middle pieces:
    its later pieces are dropped without a word (each was refused again, one count each), and
    the entry after it goes in."""
    lay = uniform_layout(layers=4, heads=4, dim=64)
    big, small = keys.chunk_key([1], lay), keys.chunk_key([2], lay)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "src")) as st:
        with Client(st.address, shm_bytes=0) as c:
            c.store(big, random_kv(lay, 512, seed=1))  # about 1.7 MB
            c.store(small, random_kv(lay, 8, seed=2))
        with AdminClient(st.address) as a:
            a.export_to(tmp_path / "e.kdnx")
    cfg = ServerConfig(port=0, data_dir=tmp_path / "dst", ram_bytes=1 << 20,
                       max_entry_bytes=1 << 20)
    with ServerThread(cfg) as t, AdminClient(t.address, max_message_bytes=64 << 10) as a:
        got = a.import_from(tmp_path / "e.kdnx")
        assert (got.imported, got.rejected) == (1, 1)
        assert a.contains(small) and not a.contains(big)
