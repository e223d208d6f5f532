"""The Grafana dashboard (deploy/grafana/dashboards/kdn.json) charts what the server exports:
a real server (RAM, Redis and LMDB tiers, auth on) is driven through every path that records
a metric (Store and Retrieve streams, GetMany over gRPC and over the same-host fast path, a
miss, a refused key), /metrics is scraped, and every metric name in every panel's PromQL and
in the template variables must be one the server exported with samples, with the labels each
query selects, groups by or prints. The datasource the panels use is the one the compose
profile provisions."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kdn import keys
from kdn.client import Client
from kdn.errors import Unauthenticated
from kdn.server import ServerConfig, ServerThread
from kdn.server.auth import digest
from kdn.store.tiered import WritePolicy
from tests.helpers import random_kv, uniform_layout
from tests.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kdn.json"
PROVISIONING = ROOT / "deploy" / "grafana" / "provisioning"
LAY = uniform_layout(layers=2, heads=2, dim=8, model="model-a")
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus when it scrapes
METRIC = re.compile(r"\bkdn_[a-z0-9_]+")


def _walk(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for p in panels:
        yield p
        yield from _walk(p.get("panels", []))  # a collapsed row holds its panels


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())  # type: ignore[no-any-return]


def _queries(dash: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(where, PromQL, legend) of every panel target and every query variable."""
    out = [(f"panel {p['title']!r}", t["expr"], t.get("legendFormat", ""))
           for p in _walk(dash["panels"]) for t in p.get("targets", [])]
    for v in dash.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
            out.append((f"variable {v['name']!r}", q, ""))
    return out


def _exported(text: str) -> dict[str, set[str]]:
    """Metric name -> the label names of its samples (names with at least one sample)."""
    out: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, rest = line.partition("{")
        name = name.split(" ")[0]
        labels = set(re.findall(r'(\w+)="', rest.rsplit("}", 1)[0])) if rest else set()
        out.setdefault(name, set()).update(labels)
    return out


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[str]]:
    tmp = tmp_path_factory.mktemp("dash")
    tenants = '{engines: {api_keys: ["sha256:' + digest("engine-key") + '"]}}'
    with RedisServer(tmp / "r") as redis_server, ServerThread(ServerConfig(
            port=0, data_dir=tmp / "d", metrics_port=0, redis_url=redis_server.url,
            auth_tenants=tenants, write_policy=WritePolicy.WRITE_BEHIND)) as st:
        a, b = keys.chunk_key([5], LAY), keys.chunk_key([6], LAY)
        with Client(st.address, api_key="engine-key", shm_bytes=0) as c:  # gRPC only
            c.store(a, random_kv(LAY, 4), mode="lossless")
            assert c.retrieve_stream(a).result() is not None  # the Retrieve stream
            assert c.retrieve(a) is not None  # GetMany
            assert c.retrieve(keys.chunk_key([7], LAY)) is None  # a miss
        with Client(st.address, api_key="engine-key") as c:  # the same-host fast path
            c.store_many([(b, random_kv(LAY, 4))], mode="raw")
            assert c.retrieve_many([b])[0] is not None
        with Client(st.address, api_key="wrong-key", retry=None) as c, \
                pytest.raises(Unauthenticated):
            c.lookup([a])
        assert st.server is not None
        text = urllib.request.urlopen(
            f"http://127.0.0.1:{st.server.metrics_port}/metrics", timeout=10).read().decode()
    return _exported(text)


def test_every_query_names_metrics_the_server_exports(exported: dict[str, set[str]]) -> None:
    queries = _queries(_dashboard())
    assert len(queries) >= 20
    for where, expr, _legend in queries:
        names = set(METRIC.findall(expr))
        assert names, f"{where}: no kdn metric in {expr!r}"
        missing = names - set(exported)
        assert not missing, f"{where}: {sorted(missing)} not exported (or without samples)"
    wanted = {m for _, e, _ in queries for m in METRIC.findall(e)}
    for must in ("kdn_tokens_requested_total", "kdn_tokens_served_total",
                 "kdn_entries_requested_total", "kdn_bytes_served_total",
                 "kdn_bytes_stored_total", "kdn_tier_read_seconds_bucket",
                 "kdn_entry_check_seconds_bucket", "kdn_fastpath_requests_total"):
        assert must in wanted, f"no panel charts {must}"  # what an operator asks first


def test_every_query_uses_labels_its_metrics_carry(exported: dict[str, set[str]]) -> None:
    for where, expr, legend in _queries(_dashboard()):
        names = set(METRIC.findall(expr))
        carried = set().union(*(exported.get(n, set()) for n in names)) | SCRAPE_LABELS
        for name, selector in re.findall(r"\b(kdn_[a-z0-9_]+)\{([^}]*)\}", expr):
            used = set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", selector))
            assert used <= exported[name] | SCRAPE_LABELS, \
                f"{where}: {name} has no label {sorted(used - exported[name])}"
        for clause in re.findall(r"\bby\s*\(([^)]*)\)", expr):
            by = {x.strip() for x in clause.split(",") if x.strip()}
            assert by <= carried, f"{where}: groups by {sorted(by - carried)}, not a label"
        for var in re.findall(r"label_values\((?:kdn_[a-z0-9_]+(?:\{[^}]*\})?,\s*)?(\w+)\)",
                              expr):
            assert var in carried, f"{where}: label_values of {var}, not a label"
        printed = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", legend))
        assert printed <= carried, f"{where}: legend prints {sorted(printed - carried)}"


def test_panels_use_the_provisioned_datasource_and_do_not_overlap() -> None:
    dash = _dashboard()
    sources = yaml.safe_load((PROVISIONING / "datasources" / "prometheus.yml").read_text())
    uids = {d["uid"] for d in sources["datasources"] if d["type"] == "prometheus"}
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["datasource"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    assert ds["current"]["value"] in uids  # the compose profile's Prometheus by default
    for p in _walk(dash["panels"]):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"]
    ids = [p["id"] for p in _walk(dash["panels"])]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: set[tuple[int, int]] = set()
    for p in _walk(dash["panels"]):
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, f"{p['title']!r} overlaps another panel"
        cells |= mine
    provider = yaml.safe_load((PROVISIONING / "dashboards" / "kdn.yml").read_text())
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in compose["volumes"]}
    path = provider["providers"][0]["options"]["path"]
    assert mounts[path] == "./deploy/grafana/dashboards", "the provider reads the mounted JSON"
    assert compose["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == \
        f"{path}/{DASHBOARD.name}"
    assert mounts["/etc/grafana/provisioning"] == "./deploy/grafana/provisioning"
