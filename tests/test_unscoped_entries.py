"""Entries stored before the server had an auth file (the unscoped key space, listed under
tenant '') stay within an admin's reach: ``tenant=UNSCOPED`` ("-") names them for inspect,
delete and ls, an admin's export records it so that the import puts them back there, and a
tenant never reaches them."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdn import keys
from kdn.cli.main import main as cli
from kdn.client import Client
from kdn.client.admin import AdminClient
from kdn.client.exportfile import read_records
from kdn.errors import PermissionDenied
from kdn.names import UNSCOPED
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout

LAY = uniform_layout(layers=2, heads=2, dim=8)
TENANTS = """
tenants:
  team-a: {api_keys: ["key-a"]}
  ops: {api_keys: ["key-ops"], role: admin}
"""


def test_admins_reach_entries_stored_before_tenants_and_tenants_never_do(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    key, other = keys.chunk_key([1], LAY), keys.chunk_key([2], LAY)
    kv = random_kv(LAY, 8, seed=1)
    data = tmp_path / "d"
    with ServerThread(ServerConfig(port=0, data_dir=data)) as st, Client(st.address) as c:
        c.store(key, kv)
        c.store(other, random_kv(LAY, 8, seed=2))
        assert c.delete(other, tenant=UNSCOPED) == 1  # no tenants: everyone's own space
    auth = tmp_path / "tenants.yaml"
    auth.write_text(TENANTS)
    auth.chmod(0o600)
    backup = tmp_path / "all.kdnx"
    with ServerThread(ServerConfig(port=0, data_dir=data, auth_file=str(auth))) as st:
        with AdminClient(st.address, api_key="key-a") as a:
            for reach in (lambda: a.inspect(key, tenant=UNSCOPED),
                          lambda: a.delete(key, tenant=UNSCOPED),
                          lambda: list(a.ls(tenant=UNSCOPED))):
                with pytest.raises(PermissionDenied):
                    reach()
            assert a.retrieve(key) is None and not list(a.ls())
        with AdminClient(st.address, api_key="key-ops") as ops:
            assert [(e.tenant, e.key) for e in ops.ls()] == [("", key)]
            assert ops.inspect(key, tenant=UNSCOPED).tenant == ""
            assert [e.key for e in ops.ls(tenant=UNSCOPED)] == [key]
            assert ops.export_to(backup) == 1
            assert [r.tenant for r in read_records(backup)[0]] == [UNSCOPED]
            assert ops.delete(key, tenant=UNSCOPED) == 1 and not list(ops.ls())
            got = ops.import_from(backup)
            assert (got.imported, got.rejected) == (1, 0)
            assert [(e.tenant, e.key) for e in ops.ls()] == [("", key)]  # back as it was
        assert cli(["admin", "inspect", key.hex()[:12], "--tenant", UNSCOPED, "--address",
                    st.address, "--api-key", "key-ops"]) == 0
        assert key.hex() in capsys.readouterr().out
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "plain")) as st, \
            Client(st.address) as c, AdminClient(st.address) as ops:  # no tenants again
        assert ops.import_from(backup).imported == 1
        assert c.retrieve(key).equal(kv)  # type: ignore[union-attr]
