"""FleetConfig: a fleet of kdn nodes as one ``kdn.client.fleet.FleetClient`` sees it (the
nodes' addresses, routing and failover settings, each node's ``Client`` options), checked
when made; ``FleetConfig.from_file`` reads it from YAML (``nodes:`` and any field by name).
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdn.checks import MAX_WAIT_S, within
from kdn.client.client import Client, check_flags
from kdn.client.routing import Router
from kdn.errors import ConfigError, InvalidArgument
from kdn.yamlfiles import load_yaml_file

FLEET_SET = {"address": "nodes", "timeout_s": "FleetConfig.timeout_s"}
"""``Client`` parameters the fleet sets itself, with where a caller sets them."""


@dataclass(frozen=True)
class FleetConfig:
    """A fleet of kdn nodes as one client sees it."""

    nodes: tuple[str, ...]
    """Addresses (host:port) of the kdn nodes; their order does not matter to routing."""
    affinity_blocks: int = 4
    """How many leading blocks of a chain name its route (``Router.route_key``)."""
    load_bound: float = 1.25
    """A node takes a new route only while its load, with the request, stays within this many
    times the mean; a route it served before stays while its load is within that
    (``Router.choose``)."""
    load_floor: float = 1024.0
    """While the live nodes' total load (in keys) is at most this, any node takes any request
    (a quiet fleet keeps a conversation's calls on one node: ``Router.choose``)."""
    load_half_life_s: float = 300.0
    """Half-life of the load a client counts for the work it sent to a node."""
    inflight_weight: float = 4.0
    """Load, in keys, of one call a node reports in flight (its Stats ``rpc.in_flight``)."""
    health_interval_s: float = 1.0
    """Seconds between health checks of every node (0 = no health thread), at most a day."""
    retry_down_s: float = 2.0
    """Seconds after which a call tries a node marked down again (doubled at each failure in a
    row, at most ``MAX_RETRY_DOWN_S``; 0 = at every call)."""
    health_timeout_s: float = 0.5
    """Deadline of one health check, at most a day."""
    timeout_s: float = 30.0
    """Deadline of a call on one node."""
    memo_keys: int = 1 << 16
    """Keys remembered with the node they were routed to (``Affinity``; 0 = none)."""
    client_options: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    """Keyword arguments for each node's ``Client`` (api_key, tls, shm_bytes, ...), but those
    the fleet sets itself (``FLEET_SET``)."""

    def __post_init__(self) -> None:
        if not isinstance(self.nodes, (list, tuple)) or not self.nodes:
            raise ConfigError("fleet: nodes must be a non-empty list of host:port addresses")
        object.__setattr__(self, "nodes", tuple(node_address(n) for n in self.nodes))
        seen: dict[str, str] = {}
        for n in self.nodes:  # one node under two names would be two nodes to routing
            same = seen.setdefault(n.replace("localhost:", "127.0.0.1:", 1), n)
            if same != n:
                raise ConfigError(f"fleet: nodes {same} and {n} are one node")
        for name, f in self.__dataclass_fields__.items():
            value, whole = getattr(self, name), f.type == "int"
            if name in ("nodes", "client_options"):
                continue
            if isinstance(value, bool) or not isinstance(value, int if whole else (int, float)):
                raise ConfigError(f"fleet: {name} must be a {'whole ' if whole else ''}number, "
                                  f"got {value!r}")
        for name in ("load_half_life_s", "health_timeout_s", "timeout_s", "health_interval_s",
                     "retry_down_s", "load_floor", "load_bound", "inflight_weight"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"fleet: {name} must be a finite number, got "
                                  f"{getattr(self, name)}")
        for name in ("load_half_life_s", "health_timeout_s", "timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"fleet: {name} must be > 0, got {getattr(self, name)}")
        if min(self.health_interval_s, self.inflight_weight, self.memo_keys,
               self.retry_down_s) < 0:
            raise ConfigError("fleet: health_interval_s, inflight_weight, memo_keys and "
                              "retry_down_s must be >= 0")
        for name, above in (("health_timeout_s", True), ("health_interval_s", False)):
            within(f"fleet: {name}", getattr(self, name), 0, MAX_WAIT_S, above=above,
                   unit=" seconds", error=ConfigError)  # 1e10: past gRPC's, threading's clocks
        check_client_options(self.client_options)
        try:
            Router(self.nodes, affinity_blocks=self.affinity_blocks, load_bound=self.load_bound,
                   load_floor=self.load_floor)
        except InvalidArgument as exc:
            raise ConfigError(f"fleet: {exc}") from None

    @classmethod
    def from_file(cls, path: Path, **overrides: Any) -> FleetConfig:
        """A YAML file: ``nodes: [host:port, ...]`` and any other field by name."""
        data = load_yaml_file(Path(path), "fleet file")  # (a key twice: refused)
        if not isinstance(data, dict) or "nodes" not in data:
            raise ConfigError(f"fleet file {path}: expected a mapping with `nodes: [host:port, "
                              "...]`")
        known = {f for f in cls.__dataclass_fields__ if f != "client_options"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"fleet file {path}: unknown settings {', '.join(unknown)}")
        return cls(**{**data, **overrides})


def check_client_options(options: object) -> None:
    """ConfigError unless ``options`` is a mapping of ``Client`` keyword arguments other than
    those the fleet sets itself (``FLEET_SET``)."""
    if not isinstance(options, dict):
        raise ConfigError(f"fleet: client_options must be a mapping of Client options, got "
                          f"{type(options).__name__}")
    takes = inspect.signature(Client.__init__).parameters
    for name in options:
        if name in FLEET_SET:
            raise ConfigError(f"fleet: client_options may not set {name!r}: the fleet sets it "
                              f"(use {FLEET_SET[name]})")
        if name == "self" or name not in takes:
            raise ConfigError(f"fleet: client_options names {name!r}, which is not an option "
                              "of Client")
    try:  # as each node's Client would, now: insecure="false" was true there
        check_flags(options.get("insecure"), options.get("tracing", False),
                    options.get("data_path", True))
    except InvalidArgument as exc:
        raise ConfigError(f"fleet: client_options: {exc}") from None


def node_address(node: object) -> str:
    """``node`` as a fleet lists it: ``host:port`` with the host in lower case and the port
    a plain number (``LOCALHOST:050051`` is ``localhost:50051``); ConfigError otherwise."""
    host, sep, port = node.rpartition(":") if isinstance(node, str) else ("", "", "")
    if not sep or not host or not (port.isascii() and port.isdigit()) or \
            not 0 < int(port) < 65536:
        raise ConfigError(f"fleet: node {node!r} is not host:port")
    return f"{host.lower()}:{int(port)}"
