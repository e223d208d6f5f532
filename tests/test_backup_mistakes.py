"""Backups that say what went wrong: an import into a server that can not hold a record's
tenant rejects it, a rejected entry's reason reaches the operator, a finished file is not taken
for a new export, and a refused export leaves no file in the way of the corrected one."""

from __future__ import annotations

from pathlib import Path

from kdn import keys
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.exportfile import read_records
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout
from tests.test_export_file import _with_tenants

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
