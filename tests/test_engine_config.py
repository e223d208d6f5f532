"""EngineConfig is checked when made (a ConfigError naming the setting, and the encoding or
value at fault), and an engine's blocks live in its client's namespace unless the config
names one."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from kdn import keys
from kdn.client import Client
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import ConfigError
from kdn.layout import DType
from kdn.server import ServerConfig, ServerThread
from tests.test_engine_devices import _model, _Tok


@pytest.mark.parametrize("setting,value,named", [
    ("encodings", (("lz4", ""),), "'lz4'"),
    ("encodings", (("raw", "int8"),), "'int8'"),
    ("encodings", (("raw", ""), ("kdn", "best")), "'best'"),
    ("encodings", ("raw",), "'raw'"),
    ("encodings", (("raw", "", "x"),), "pair"),
    ("encodings", (("raw", None),), "pair"),
    ("encodings", "raw", "pairs"),
    ("encodings", (), "at least one"),
    ("encodings", (("raw", ""), ("raw", "")), "twice"),
    ("encodings", (("kdn", "default"), ("raw", ""), ["kdn", "default"]), "'default'"),
    ("chunk_tokens", -1, "-1"),
    ("chunk_tokens", 1.5, "1.5"),
    ("chunk_tokens", True, "True"),
    ("chunk_tokens", 10**9, "1000000000"),
    ("calibration_tokens", 0, "0"),
    ("calibration_tokens", math.nan, "nan"),
    ("calibration_tokens", 10**7, "10000000"),
    ("lookup_timeout_s", math.nan, "nan"),
    ("lookup_timeout_s", math.inf, "inf"),
    ("lookup_timeout_s", 0, "0"),
    ("lookup_timeout_s", True, "True"),
    ("lookup_timeout_s", 1e300, "1e+300"),  # no deadline a call can carry
    ("lookup_timeout_s", 86400.5, "a day"),
    ("namespace", "bad space", "'bad space'"),
    ("namespace", "a" * 100, "malformed"),
    ("weights_id", "", "names no weights"),  # not the default: two checkpoints would share keys
    ("weights_id", "  ", "names no weights"),
    ("kv_dtype", "fp16", "'fp16'"),
    ("store_back", "yes", "'yes'"),
    ("freeze_heap", 1, "1"),
])
def test_a_bad_setting_is_refused_naming_it(setting: str, value: object, named: str) -> None:
    with pytest.raises(ConfigError) as got:
        EngineConfig(**{setting: value})  # type: ignore[arg-type]
    assert str(got.value).startswith(f"{setting}: ") and named in str(got.value), got.value


def test_good_settings_are_taken_in_one_form() -> None:
    cfg = EngineConfig(encodings=[["raw", ""], ("kdn", "default")],  # type: ignore[arg-type]
                       kv_dtype="float16", lookup_timeout_s=1)  # type: ignore[arg-type]
    assert cfg.encodings == (("raw", ""), ("kdn", "default")) and cfg.kv_dtype is DType.FLOAT16
    assert EngineConfig(namespace="").namespace == "" and EngineConfig().namespace is None
    assert EngineConfig(lookup_timeout_s=86400).lookup_timeout_s == 86400


def test_a_lookup_and_a_load_wait_no_longer_than_the_clients_deadline(tmp_path: Path) -> None:
    """lookup_timeout_s (a day at most) is capped by the client's timeout_s, for the lookup
    and for the least a load is given alike."""
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st, Client(st.address, timeout_s=0.5) as c:
        engine = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c, EngineConfig(
            chunk_tokens=32, encodings=(("raw", ""),), calibrate=False, lookup_timeout_s=86400))
        assert engine._lookup_timeout() == 0.5 and engine._load_deadline(0.0) == 0.5
        engine.generate(list(range(1, 70)), max_new_tokens=1)
        engine.wait_for_save(30)
        assert engine.matched_tokens(list(range(1, 70))) == 64


def test_the_engine_stores_in_its_clients_namespace(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    ids = list(range(1, 70))
    with ServerThread(cfg) as st, Client(st.address, namespace="team-a") as c:
        model = _model(torch.float32, "cpu")
        raw = EngineConfig(chunk_tokens=32, encodings=(("raw", ""),), calibrate=False)
        engine = KDNEngine(model, _Tok(), c, raw)
        assert engine.namespace == "team-a"
        with engine:
            engine.generate(ids, max_new_tokens=1)
        block = keys.variant_key(keys.prefix_keys(ids[:32], engine.layout, "team-a", 32)[0],
                                 "raw")
        assert c.contains(block, namespace="team-a")
        assert not c.contains(block, namespace="default")
        named = KDNEngine(model, _Tok(), c, EngineConfig(namespace="other", chunk_tokens=32))
        assert named.namespace == "other" and named.matched_tokens(ids) == 0
        assert KDNEngine(model, _Tok(), c, EngineConfig(namespace="")).namespace == "team-a"
