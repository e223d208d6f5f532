"""The model side's building blocks load without grpc or the client, and ``kdn``'s top-level
names are imported on first use. Each import runs in a fresh interpreter."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

GRPC_FREE = ["kdn", "kdn.layout", "kdn.codec", "kdn.errors", "kdn.keys", "kdn.options",
             "kdn.cache", "kdn.delivery", "kdn.transport.wire", "kdn.transport.metadata"]


def _run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("module", GRPC_FREE)
def test_import_does_not_load_grpc(module: str) -> None:
    _run(f"""
        import sys, {module}
        loaded = [m for m in ("grpc", "kdn.client") if m in sys.modules]
        assert not loaded, f"import {module} loaded {{loaded}}"
    """)


def test_top_level_names_are_lazy() -> None:
    _run("""
        import sys, kdn
        assert "grpc" not in sys.modules
        from kdn import Client, Durability, StoreOptions, keys
        assert Client is sys.modules["kdn.client.client"].Client
        assert keys is sys.modules["kdn.keys"]
        assert StoreOptions().durability is Durability.DEFAULT
        assert set(kdn.__all__) <= set(dir(kdn))
        assert all(getattr(kdn, name) is not None for name in kdn.__all__)
        try:
            kdn.NoSuchName
        except AttributeError:
            pass
        else:
            raise AssertionError("kdn.NoSuchName resolved")
    """)
