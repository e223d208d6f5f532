"""Server configuration: one frozen dataclass, one loader for YAML file + KDN_* env + flags.

Precedence (later wins): defaults < YAML file < ``KDN_<FIELD>`` environment variables < flags.
Any other ``KDN_*`` variable is refused, save those of ``kdn.server.variables`` (the clients'
and scripts', and Kubernetes' service links for a Service named kdn).
Every value is validated at start-up; an error names the setting and where it came from.
Sizes accept plain byte counts or units: ``512MiB``, ``2GB``, ``1.5GiB``.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from kdn.checks import MAX_BYTES, MAX_WAIT_S, shown, within
from kdn.errors import ConfigError
from kdn.server import variables
from kdn.server.secretfile import check_private, check_trusted
from kdn.server.variables import LINKS_HINT, OTHER_VARIABLES, kubernetes_link
from kdn.store.redis_urls import cluster_urls, shown_url
from kdn.store.tiered import WritePolicy
from kdn.transport.addresses import host_port, is_loopback, listen_host
from kdn.yamlfiles import load_yaml_file

TIER_NAMES = ("ram", "redis", "disk")
MIN_DISK_BYTES = 1 << 20
"""The smallest disk tier: below it LMDB's own pages leave no room for an entry, and every
write would be refused."""
DEFAULT_DISK_BYTES = 16 << 30
"""The disk tier's budget where none is set: cut quietly where the disk holds less."""

GRPC_INT_MAX = 2**31 - 1
"""The largest value of a gRPC channel argument (a C int): a count, or a duration in ms."""

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20,
          "g": 2**30}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")


MAX_SIZE = MAX_BYTES
"""The largest size a setting takes (8 EiB): sizes travel in 64-bit fields (Stats), and no
budget comes near it; past it is a typo."""
MAX_REDIS_CONNECTIONS = 1 << 16
"""The largest ``redis_max_connections``: redis-py's pool holds a slot per connection."""


def parse_size(value: object) -> int:
    """Bytes of a size setting: a whole number or a size like 512MiB or 1.5GiB (a fraction
    only with a unit above bytes), at most ``MAX_SIZE``; ValueError otherwise."""
    if isinstance(value, bool):
        raise ValueError("a size, not a boolean")
    if isinstance(value, int):
        got = value
    else:
        m = _SIZE_RE.match(str(value)) if isinstance(value, (str, float)) else None
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"expected a size like 512MiB or 1073741824, got {shown(value)}")
        unit = _UNITS[m.group(2).lower()]
        number = float(m.group(1)) * unit
        if unit == 1 and not number.is_integer():  # (YAML's 1.5: 1 byte, 0.5: 0 bytes)
            raise ValueError(f"a whole number of bytes, or a size with a unit like 1.5GiB; got "
                             f"{shown(value)}")
        if not number <= MAX_SIZE:  # (inf, from 400 digits)
            raise ValueError(f"at most {MAX_SIZE} bytes (8 EiB), got {shown(value)}")
        got = int(number)
    if got > MAX_SIZE:
        raise ValueError(f"at most {MAX_SIZE} bytes (8 EiB), got {shown(value)}")
    return got


@dataclass(frozen=True)
class ServerConfig:
    """Everything ``kdn serve`` needs. Field docstrings are shown by ``kdn serve --help``."""

    host: str = "127.0.0.1"
    """Address to listen on (an IPv6 one as ::1 or [::1])."""
    port: int = 50051
    """TCP port to listen on (0 = any free port)."""
    data_port: int = 0
    """TCP port of the network data path: GetMany / PutMany of clients on other hosts with
    the entries' bytes on a plain socket next to gRPC (kdn.server.netpath; ~2x Python gRPC's
    rate), on the same host address; 0 = any free port (clients learn it from Attach), -1 =
    off. With tls_cert it speaks TLS too, with the same certificate. Publish it next to the
    gRPC port where a firewall or container stands between them."""
    data_dir: Path = Path("kdn-data")
    """Directory holding the LMDB disk tier."""
    ram_bytes: int = 1 << 30
    """Byte budget of the RAM tier."""
    wire_memo_bytes: int = 256 << 20
    """Bytes of Retrieve messages kept for the RAM-tier entries read last, sent again without
    being built (kdn.server.wire_memo); 0 = off. Memory on top of ram_bytes, at most a quarter
    of it."""
    shm_arena_bytes: int = 512 << 20
    """Bytes of each tenant's read arena: the RAM-tier entries its same-host clients read
    last, handed to them as leased ranges of a sealed shared memfd instead of copied per read
    (kdn.server.arena); 0 = off. Made when a tenant's client first asks, and then faulted
    in whole by a background thread (so that a first read allocates no pages); memory on
    top of ram_bytes, at most a quarter of it."""
    prefault_bytes: int = 1 << 30
    """Free memory kept faulted in ahead of demand for the large entries stores bring
    (kdn.transport.prefault: a background thread maps and faults it in, so that a cache that
    fills stores at the speed of a copy, not of the kernel's page faults); 0 = off. At most a
    quarter of ram_bytes; grown from the first large store on, up to ram_bytes plus this in
    all, and kept."""
    disk_bytes: int = DEFAULT_DISK_BYTES
    """Byte budget of the LMDB disk tier (0 = no disk tier; else at least 1MiB). Cut to 75% of
    the room its filesystem has where it is more (kdn.store.diskroom): quietly for this
    default (the ready line shows the budget taken), with a warning for a budget one set."""
    redis_url: str = ""
    """Redis URL for the shared tier (redis://host:port/db); empty = no Redis tier. With
    redis_cluster, comma-separated URLs of cluster nodes to discover the cluster from: each with
    the same user, password and scheme (rediss:// for TLS), database 0, no unix:// socket."""
    redis_cluster: bool = False
    """redis_url points at a Redis Cluster (shared by several kdn servers) instead of one server."""
    redis_bytes: int = 0
    """Memory budget set on Redis (maxmemory per master, allkeys-lru; set again on a master
    that was down at start, restarted or promoted); 0 = keep Redis's own. kdn servers sharing a
    Redis set the same one: a master holding another under allkeys-lru is left so (said once)."""
    redis_part_bytes: int = 8 << 20
    """Largest single Redis value; bigger entries are split into parts of this size (cut to
    512MiB less a manifest's 40-byte header, the most one Redis value holds by default)."""
    redis_timeout_s: float = 1.0
    """Connect and read timeout of one Redis command attempt, in seconds (at most a day)."""
    redis_retries: int = 2
    """Retries of a Redis command on connection errors (exponential backoff); one that timed
    out is not sent again (a stopped or cut-off Redis costs a call one ``redis_timeout_s``)."""
    redis_max_connections: int = 32
    """Connection pool size (per node in a cluster), at most 65536."""
    redis_wait_replicas: int = 0
    """Replicas that must hold each write into Redis before it counts as done (Redis WAIT;
    0 = the master's acceptance is enough). A SHARED store then survives its master's loss."""
    redis_wait_timeout_s: float = 1.0
    """How long a write waits for those replicas before it fails (and is withdrawn), in
    seconds (at most a day)."""
    tier_order: tuple[str, ...] = TIER_NAMES
    """Read order of the tiers, ram first (e.g. ram,disk,redis); unconfigured tiers are skipped."""
    write_policy: WritePolicy = WritePolicy.WRITE_THROUGH
    """write-through: Store returns once every lower tier has the entry; write-behind: once RAM
    has it (lower tiers written by a background queue, flushed at shutdown)."""
    write_queue_entries: int = 1024
    """Most pending writes per lower tier (write-behind, and retries while a tier is down)."""
    write_queue_bytes: int = 256 << 20
    """Most bytes of pending writes per lower tier; a full queue falls back to direct writes."""
    default_ttl_s: float = 0.0
    """Expiry of entries stored without a TTL, in seconds (0 = never)."""
    demote_on_evict: bool = True
    """Write entries evicted from RAM to the next tier down instead of dropping them."""
    max_message_bytes: int = 256 << 20
    """Largest single gRPC message accepted or sent: one frame (one layer, or more when they are
    small) travels in one message, and a Llama-3-8B layer of 32k fp16 tokens is 128 MiB."""
    max_entry_bytes: int = 8 << 30
    """Largest stored entry (header plus frames): a guard; an 8B model's 32k-token fp16 cache
    is 4 GiB. A Store receives into one buffer of the declared size (no second copy)."""
    allowed_models: tuple[str, ...] = ()
    """Model fingerprints this server accepts (empty = any)."""
    model: str = ""
    """Model the Blend RPC runs ("smollm2-135m" or a transformers folder); empty = no Blend."""
    max_blend_pieces: int = 256
    """Most pieces (chunks and texts) of one Blend; its tokens are capped by the model's
    context (max_position_embeddings). Each piece costs reads and work before the blend runs."""
    auth_file: str = ""
    """YAML file of tenants: `tenants: {NAME: {api_keys: [KEY or "sha256:HEX"], subjects:
    [client certificate names: cn:|dns:|uri:|email:|ip:NAME], role: tenant|admin, rate_rps: N,
    burst: N, quota_bytes: 10GiB, egress_bytes_per_s: 125MB}}` (mode 600); unset = no
    authentication (given empty, it is refused)."""
    auth_tenants: str = ""
    """The tenants as YAML or JSON text, in the auth file's `tenants:` format but with API keys
    as "sha256:HEX" digests only (for an environment variable: KDN_AUTH_TENANTS; a digest is
    no key). Instead of auth_file."""
    tls_cert: str = ""
    """PEM certificate chain of the server; with tls_key, the server speaks TLS only."""
    tls_key: str = ""
    """PEM private key of the server certificate."""
    tls_client_ca: str = ""
    """PEM CA bundle; when set, clients must present a certificate it signed (mutual TLS)."""
    mtls_role: str = "tenant"
    """Role under mutual TLS without a tenants file of a client that sends no API key:
    tenant (the unscoped key space, no admin RPCs), admin, or none (refused). Never admin
    unless set so. With a tenants file, its `subjects` (certificate CN or SAN, e.g.
    "uri:spiffe://...") name tenants and other certificates need an API key (admin or none
    there is refused)."""
    insecure: bool = False
    """Accept API keys over plaintext on a non-loopback host (auth on, TLS off). Without it such
    a server refuses to start; with it, it warns at every start."""
    egress_bytes_per_s: int = 0
    """Most bytes per second sent to one client connection (entries read over gRPC or the
    network data path; sizes as elsewhere: 125MB = 1 Gbit/s); 0 = unlimited. A tenant's own
    cap (egress_bytes_per_s in the tenants file) is shared by its connections; the stricter
    applies (kdn.server.egress). The same-host path is not limited."""
    idle_timeout_s: float = 300.0
    """Close a client connection that carried no call for this long (0 = never); on the
    network data path, a connection its ticket admitted (kdn.server.netpath). A gRPC call that
    moves no message this long ends, a unary one whose request is not whole by then too."""
    max_connection_age_s: float = 0.0
    """Ask clients to reconnect once a connection is this old (0 = never; calls in flight get
    30 s more)."""
    max_connections: int = 1024
    """Most client connections open at once; more are refused until some close (0 = no cap)."""
    handshake_timeout_s: float = 10.0
    """Close a connection that has not finished its TLS handshake and HTTP/2 preface this long
    after it opened (one that never says a word would otherwise hold a slot for 120 s); on the
    network data path and the same-host fast path, one whose first call has not named a live
    ticket or segment by then, and any call whose request is not whole this long after its
    first byte; on gRPC, a health or reflection call (no key) whose request is not whole."""
    max_streams_per_connection: int = 256
    """Most calls in flight on one client connection (HTTP/2 concurrent streams); a client
    past it waits for one to end (0 = gRPC's own limit)."""
    reuse_port: bool = False
    """Let several processes listen on the same port (SO_REUSEPORT): off, so that a second
    server on a port another process holds fails to start instead of splitting the clients."""
    metrics_host: str = "127.0.0.1"
    """Address of the Prometheus /metrics HTTP endpoint."""
    metrics_port: int = -1
    """Port of the /metrics endpoint (-1 = off, 0 = any free port)."""
    shutdown_grace_s: float = 10.0
    """Seconds in-flight calls (gRPC, fast path, data path) get to finish on shutdown."""
    log_level: str = "INFO"
    """Python logging level name."""
    tracing: bool = False
    """OpenTelemetry spans per RPC and per tier call, continuing the client's trace (needs the
    opentelemetry-api package: the tracing extra; the exporter is the process's own)."""
    log_format: str = "text"
    """Log lines as text, or json: one JSON object per line (ts, level, logger, request_id,
    and the access and audit logs' fields)."""

    def __post_init__(self) -> None:
        if not isinstance(self.data_dir, (str, os.PathLike)):
            raise ConfigError(f"data_dir: expected a folder's path, got {self.data_dir!r}")
        if isinstance(self.data_dir, str) and not self.data_dir.strip():  # KDN_DATA_DIR= (an
            raise ConfigError("data_dir: must not be empty (it would be the current folder); "
                              "give a folder's path, . for the current one")  # unset variable)
        object.__setattr__(self, "data_dir", Path(self.data_dir))  # a str: as a flag gives it
        for f in fields(self):  # from code, insecure="false" was true: no text for a bool
            value = getattr(self, f.name)
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise ConfigError(f"{f.name}: expected true or false (a bool), got {shown(value)}")
            if f.name in ("log_level", "log_format") and not isinstance(value, str):
                raise ConfigError(f"{f.name}: expected a name, got {shown(value)}")
        for f in fields(self):  # NaN would pass every range check below; inf is no duration
            if f.type in ("float", float) and not math.isfinite(getattr(self, f.name)):
                raise ConfigError(f"{f.name}: must be a finite number, got {getattr(self, f.name)}")
        for name in sorted(_SIZE_FIELDS):  # 64-bit fields carry them (Stats)
            if isinstance(getattr(self, name), int) and getattr(self, name) > MAX_SIZE:
                raise ConfigError(f"{name}: at most {MAX_SIZE} bytes (8 EiB), got "
                                  f"{getattr(self, name)}")
        for name in ("host", "metrics_host"):  # [::1], as in an address: the host is ::1
            if isinstance(value := getattr(self, name), str):
                object.__setattr__(self, name, listen_host(value, name))
        for name in ("host", "metrics_host"):  # "": an unset variable (KDN_METRICS_HOST=)
            if not getattr(self, name):
                raise ConfigError(f"{name}: must not be empty")
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"port: must be in 0..65535, got {self.port}")
        if self.ram_bytes <= 0:
            raise ConfigError(f"ram_bytes: must be > 0, got {self.ram_bytes}")
        if self.disk_bytes < 0 or 0 < self.disk_bytes < MIN_DISK_BYTES:
            raise ConfigError(f"disk_bytes: must be 0 (no disk tier) or at least "
                              f"{format_size(MIN_DISK_BYTES)}, got {self.disk_bytes}")
        if self.wire_memo_bytes < 0:
            raise ConfigError(f"wire_memo_bytes: must be >= 0, got {self.wire_memo_bytes}")
        if self.prefault_bytes < 0:
            raise ConfigError(f"prefault_bytes: must be >= 0, got {self.prefault_bytes}")
        if self.shm_arena_bytes < 0:
            raise ConfigError(f"shm_arena_bytes: must be >= 0, got {self.shm_arena_bytes}")
        if not 1024 <= self.max_message_bytes <= (2**31 - 1):
            raise ConfigError(
                f"max_message_bytes: must be in 1KiB..2GiB-1, got {self.max_message_bytes}"
            )
        if self.max_entry_bytes <= 0:
            raise ConfigError(f"max_entry_bytes: must be > 0, got {self.max_entry_bytes}")
        if self.max_blend_pieces <= 0:
            raise ConfigError(f"max_blend_pieces: must be > 0, got {self.max_blend_pieces}")
        if self.shutdown_grace_s < 0:
            raise ConfigError(f"shutdown_grace_s: must be >= 0, got {self.shutdown_grace_s}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("tls_cert/tls_key: set both (or neither)")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("tls_client_ca: mutual TLS needs tls_cert and tls_key too")
        for name in ("auth_file", "tls_cert", "tls_key", "tls_client_ca"):
            path = getattr(self, name)
            if path and not Path(path).is_file():
                raise ConfigError(f"{name}: no such file {path!r}")
        for name in ("auth_file", "tls_key"):  # secrets: API keys (or digests), private key
            if getattr(self, name):
                check_private(name, Path(getattr(self, name)))
        if self.tls_client_ca:  # its CAs say who a certificate is, an admin too
            check_trusted("tls_client_ca", Path(self.tls_client_ca))
        if self.auth_file and self.auth_tenants:
            raise ConfigError("auth_tenants: set it or auth_file, not both")
        if self.mtls_role not in ("tenant", "admin", "none"):
            raise ConfigError(f"mtls_role: expected tenant, admin or none, got {self.mtls_role!r}")
        if self.mtls_role != "tenant" and (self.auth_file or self.auth_tenants):
            raise ConfigError(f"mtls_role: {self.mtls_role} applies only without a tenants file "
                              f"({'auth_file' if self.auth_file else 'auth_tenants'} is set: "
                              "its tenants' subjects say who a certificate is)")
        if self.mtls_role != "tenant" and not self.tls_client_ca:
            raise ConfigError(f"mtls_role: {self.mtls_role} applies only under mutual TLS; set "
                              "tls_client_ca")
        if (self.auth_file or self.auth_tenants) and not self.tls_cert and not self.insecure and \
                not is_loopback(self.host):
            raise ConfigError(
                f"{'auth_file' if self.auth_file else 'auth_tenants'}: API keys would cross "
                f"the network in plaintext on {self.host}; set tls_cert and tls_key, or "
                "insecure: true (--insecure true, KDN_INSECURE=true) to accept that")
        if self.egress_bytes_per_s < 0:
            raise ConfigError(
                f"egress_bytes_per_s: must be >= 0 (0 = unlimited), got {self.egress_bytes_per_s}")
        for name in ("max_connections", "max_streams_per_connection"):
            if not 0 <= getattr(self, name) <= GRPC_INT_MAX:
                raise ConfigError(f"{name}: must be in 0..{GRPC_INT_MAX} (a C int of gRPC's), "
                                  f"got {getattr(self, name)}")
        for name in ("idle_timeout_s", "max_connection_age_s", "handshake_timeout_s"):
            value = getattr(self, name)  # gRPC takes it in whole milliseconds, a C int
            if value < 0 or int(value * 1000) > GRPC_INT_MAX or 0 < value < 0.001:
                raise ConfigError(
                    f"{name}: must be 0 or in 0.001..{GRPC_INT_MAX / 1000} seconds (24.8 "
                    f"days: gRPC holds it in milliseconds as a 32-bit int), got {value}")
        if not -1 <= self.data_port <= 65535:
            raise ConfigError(f"data_port: must be in -1..65535, got {self.data_port}")
        if not -1 <= self.metrics_port <= 65535:
            raise ConfigError(f"metrics_port: must be in -1..65535, got {self.metrics_port}")
        for name in ("data_port", "metrics_port"):
            if self.port and getattr(self, name) == self.port:
                raise ConfigError(f"{name}: must differ from port (both {self.port}); pick "
                                  "another, or 0 for any free port")
        if self.data_port > 0 and self.data_port == self.metrics_port:
            raise ConfigError(f"data_port and metrics_port: must differ (both {self.data_port})")
        if self.log_format not in ("text", "json"):
            raise ConfigError(f"log_format: expected text or json, got {self.log_format!r}")
        if self.log_level.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
            raise ConfigError(f"log_level: unknown level {self.log_level!r}")
        if not isinstance(self.redis_url, str):  # never its value: it may hold a password
            raise ConfigError(f"redis_url: expected text (comma-separated URLs), got a "
                              f"{type(self.redis_url).__name__}")
        for url in self.redis_urls:  # shown_url: the URL without its password
            if not url.startswith(("redis://", "rediss://", "unix://")):
                raise ConfigError(f"redis_url: expected redis://host:port, got {shown_url(url)}")
            try:  # raises for a port that is no number or out of range, an unclosed [IPv6]
                port = urlparse(url).port
            except ValueError as exc:
                raise ConfigError(f"redis_url: {shown_url(url)} is not a valid URL: {exc}") \
                    from None
            if port == 0:
                raise ConfigError(f"redis_url: {shown_url(url)} names port 0, which no server "
                                  "listens on")
        if len(self.redis_urls) > 1 and not self.redis_cluster:
            raise ConfigError("redis_url: several URLs need redis_cluster: true")
        if self.redis_cluster and not self.redis_url:
            raise ConfigError("redis_cluster: set, but redis_url names no cluster node")
        if self.redis_cluster:  # no unix://, no database but 0, one login and TLS for all
            cluster_urls(self.redis_urls)
        if self.redis_bytes < 0:
            raise ConfigError(f"redis_bytes: must be >= 0, got {self.redis_bytes}")
        if not 1 << 10 <= self.redis_part_bytes <= 512 << 20:
            raise ConfigError(
                f"redis_part_bytes: must be in 1KiB..512MiB, got {self.redis_part_bytes}")
        if not 0 <= self.redis_retries <= 10:
            raise ConfigError(f"redis_retries: must be in 0..10, got {self.redis_retries}")
        if not 0 <= self.redis_wait_replicas <= 16:
            raise ConfigError(
                f"redis_wait_replicas: must be in 0..16, got {self.redis_wait_replicas}")
        for name in ("redis_timeout_s", "redis_wait_timeout_s"):  # 1e10: redis-py's sockets
            within(name, getattr(self, name), 0, MAX_WAIT_S, above=True, unit=" seconds",
                   error=ConfigError)  # overflowed (a crash at start, every store failing)
        within("redis_max_connections", self.redis_max_connections, 1, MAX_REDIS_CONNECTIONS,
               whole=True, error=ConfigError)  # 1e12: redis-py's pool filled memory at start
        order = self.tier_order
        unknown = [t for t in order if t not in TIER_NAMES]
        if unknown or len(set(order)) != len(order) or not order or order[0] != "ram":
            raise ConfigError(f"tier_order: expected distinct names of {TIER_NAMES} with ram "
                              f"first, got {order!r}")
        for name, on in (("redis", bool(self.redis_url)), ("disk", self.disk_bytes > 0)):
            if on and name not in order:
                raise ConfigError(f"tier_order: the {name} tier is configured but not listed")
        if self.write_policy not in list(WritePolicy):  # (a str of a member's value is taken)
            raise ConfigError(f"write_policy: expected one of {[p.value for p in WritePolicy]}, "
                              f"got {self.write_policy!r}")
        object.__setattr__(self, "write_policy", WritePolicy(self.write_policy))
        if self.write_queue_entries < 1:
            raise ConfigError(
                f"write_queue_entries: must be >= 1, got {self.write_queue_entries}")
        if self.write_queue_bytes < 1:
            raise ConfigError(f"write_queue_bytes: must be >= 1, got {self.write_queue_bytes}")
        if self.default_ttl_s < 0:
            raise ConfigError(f"default_ttl_s: must be >= 0, got {self.default_ttl_s}")

    @property
    def redis_urls(self) -> list[str]:
        return [u.strip() for u in self.redis_url.split(",") if u.strip()]

    @property
    def address(self) -> str:
        """``host:port`` for gRPC (an IPv6 host in brackets)."""
        return host_port(self.host, self.port)


_SIZE_FIELDS = {"ram_bytes", "wire_memo_bytes", "shm_arena_bytes", "prefault_bytes",
                "disk_bytes",
                "max_message_bytes", "max_entry_bytes", "redis_bytes", "redis_part_bytes",
                "write_queue_bytes", "egress_bytes_per_s"}
_KINDS = {"int": "a whole number", "float": "a number", "Path": "a path", "str": "text"}
"""What a setting of each type takes, in a refusal's words."""
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


_WHO_MAY_ENTER = ("auth_file", "auth_tenants", "tls_client_ca")
"""Settings that let callers in only by name: one given empty (a Secret that came out empty,
a template that rendered nothing) is refused, not read as unset (no authentication)."""


def _coerce(name: str, value: Any, source: str) -> Any:
    kind = {f.name: f.type for f in fields(ServerConfig)}[name]
    if name in _WHO_MAY_ENTER and isinstance(value, str) and not value.strip():
        raise ConfigError(f"{name}: {source} is given but empty, which would turn "
                          f"{'mutual TLS' if name == 'tls_client_ca' else 'authentication'} "
                          f"off; give it a value, or unset it to serve without")
    try:
        if name in _SIZE_FIELDS:
            return parse_size(value)
        if kind in ("bool", bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text not in _TRUE | _FALSE:
                raise ValueError("expected true or false")
            return text in _TRUE
        if kind in ("WritePolicy", WritePolicy):
            try:
                return WritePolicy(str(value).strip().lower())
            except ValueError:
                raise ValueError(f"expected one of {[p.value for p in WritePolicy]}") from None
        if str(kind).startswith("tuple"):
            items = value if isinstance(value, (list, tuple)) else [value]
            if not all(isinstance(v, (str, int, float)) for v in items):
                raise ValueError("expected a list of names")
            items = [p for v in items for p in str(v).split(",")]
            return tuple(v.strip() for v in items if v.strip())
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):  # a list, a
            raise ValueError(f"expected {_KINDS.get(str(kind), 'a value')}")  # mapping, YAML's
        # true (host: true was the text "True"): never str() of it
        if kind in ("int", int):
            if isinstance(value, float) and not value.is_integer():
                raise ValueError("not a whole number")
            return int(value)
        if kind in ("float", float):
            return float(value)
        if kind in ("Path", Path):
            if not str(value).strip():  # KDN_DATA_DIR= (a variable set from an unset one)
                raise ValueError("must not be empty (it would be the current folder); give a "
                                 "folder's path, . for the current one")
            return Path(os.path.expanduser(str(value)))
        return str(value)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ConfigError(f"{name}: invalid value {_in_error(name, value)} (from {source}): "
                          f"{exc}") from None


def load_config(
    file: Path | str | None = None,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
    notes: list[str] | None = None,
) -> ServerConfig:
    """Merge defaults, a YAML file, KDN_* variables and flags into a validated ServerConfig.
    A variable that overrides another value the file sets is a warning naming both (a
    container image's ENV defaults beat a mounted file: its ``metrics_port: -1`` ignored):
    appended to ``notes`` where given (``kdn serve`` logs them once its logging is set up, in
    its format), else logged as a WARNING."""
    said: list[str] = [] if notes is None else notes
    known = {f.name for f in fields(ServerConfig)}
    values: dict[str, Any] = {}
    from_file: dict[str, Any] = {}
    if file is not None:
        path = Path(file)
        raw = load_yaml_file(path, "config file")
        check_trusted("config file", path)
        if not isinstance(raw, dict):
            raise ConfigError(f"config file {path}: expected a mapping of settings")
        for k, v in raw.items():
            if k not in known:
                raise ConfigError(f"{k}: unknown setting (in {path}); known: {sorted(known)}")
            if v is not None:  # null (``host:`` alone too): unset, the default
                values[k] = from_file[k] = _coerce(k, v, str(path))
    env = os.environ if env is None else env
    check_variables(env)
    for k, v in env.items():
        if not k.startswith("KDN_") or k in OTHER_VARIABLES:
            continue
        if kubernetes_link(k, v):
            if k == "KDN_PORT":  # it replaced the image's KDN_PORT: the file's or the default
                said.append(f"port: $KDN_PORT ({v}) is not taken as the port: it is "
                            f"{LINKS_HINT}")
            continue
        name = k[4:].lower()
        values[name] = _coerce(name, v, f"${k}")
        if name in from_file and from_file[name] != values[name] \
                and (flags or {}).get(name) is None:
            said.append(f"{name}: ${k} ({_brief(name, values[name])}) overrides "
                        f"{_brief(name, from_file[name])} in {file} (the environment beats "
                        f"the config file: unset ${k} to take the file's)")
    for k, v in (flags or {}).items():
        if v is None:
            continue
        if k not in known:
            raise ConfigError(f"{k}: unknown setting")
        values[k] = _coerce(k, v, f"--{k.replace('_', '-')}")
    if notes is None:
        for line in said:
            logging.getLogger("kdn.server.config").warning("%s", line)
    try:
        return ServerConfig(**values)
    except ConfigError:
        raise
    except TypeError as exc:
        raise ConfigError(str(exc)) from None


def check_variables(env: Mapping[str, str]) -> None:
    """Refuse a ``KDN_*`` variable that is no server setting, ``OTHER_VARIABLES`` nor Kubernetes
    service link (a misspelling would be ignored), naming the nearest (``kdn.server.variables``);
    ``kdn serve``, ``kdn admin`` and ``kdn rag`` all check their environment this way."""
    variables.check_variables(env, (f.name for f in fields(ServerConfig)))


def format_size(n: int) -> str:
    """``n`` bytes the way a person writes it: ``1GiB``, ``256MiB``, ``1000`` (exact only)."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def _shown(name: str, value: Any) -> str:
    if name in _SIZE_FIELDS:
        return format_size(int(value))
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or '""'
    if isinstance(value, enum.Enum):
        return str(value.value)
    return str(value) if value != "" else '""'


def _brief(name: str, value: Any) -> str:
    """``value`` as help shows it (a path as written, a size with its unit; a ``redis_url``
    without its passwords); a text (a tenants file's, a list of URLs) cut at 60 characters."""
    text = shown_url(str(value)) if name == "redis_url" else _shown(name, value)
    return text if not isinstance(value, str) or len(text) <= 60 else text[:57] + "..."


def _in_error(name: str, value: Any) -> str:
    """``value`` of setting ``name`` as an error shows it: ``shown``, but a ``redis_url``
    without its passwords (``shown_url``), and only the type of one that is no text."""
    if name != "redis_url":
        return shown(value)
    if not isinstance(value, str):
        return f"(a {type(value).__name__})"
    return shown(shown_url(value))


def _field_docs() -> dict[str, str]:
    """Each setting's docstring (the string literal under its field, the convention Sphinx
    reads), from the class's syntax tree."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(ServerConfig)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for field_node, doc_node in zip(body, body[1:]):
        if isinstance(field_node, ast.AnnAssign) and isinstance(field_node.target, ast.Name) \
                and isinstance(doc_node, ast.Expr) and isinstance(doc_node.value, ast.Constant) \
                and isinstance(doc_node.value.value, str):
            docs[field_node.target.id] = " ".join(doc_node.value.value.split())
    return docs


def describe() -> list[tuple[str, str, str]]:
    """(name, default as one would write it, doc) of every setting, for help output."""
    docs = _field_docs()
    return [(f.name, _shown(f.name, f.default), docs.get(f.name, ""))
            for f in dataclasses.fields(ServerConfig)]
