"""Building and running a kdn server.

    server = await start_server(config)   # listening; server.port is the bound port
    await server.wait()                   # until stop() (or a signal in ``serve``)
    await server.stop()                   # in-flight calls (gRPC, fast path, data path) get
                                          # shutdown_grace_s; then the store closes

``serve(config)`` is what ``kdn serve`` runs: start, install SIGINT/SIGTERM/SIGHUP handlers (each
a graceful stop), wait, stop.
``ServerThread`` runs a server on its own event loop in a background thread (tests, benchmarks).

Health (the standard gRPC health service): ``""`` is SERVING while the local tiers (RAM, disk)
work; ``kdn.v1.KDN`` is SERVING while every tier works and NOT_SERVING while the store is
degraded (e.g. Redis down: the server still serves from RAM and disk). Load balancers should
watch ``""``; ``kdn.v1.KDN`` and the Stats RPC (``healthy`` per tier, ``store.degraded``) say why.
Each change is logged: a WARNING where it got worse, an INFO line where it got better.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kdn import tracing
from kdn.cli.output import human_size
from kdn.errors import ConfigError, DiskFull, InUse, KDNError, again, kept
from kdn.server.admin import AdminServicer
from kdn.server.auth import (
    AuthConfig,
    Authenticator,
    Role,
    certificates_unasked,
    load_auth,
    tenants_from_text,
)
from kdn.server.blend_rpc import Blender
from kdn.server.config import DEFAULT_DISK_BYTES, ServerConfig
from kdn.server.fastpath import FastPath
from kdn.server.ingest import recount_usage
from kdn.server.netpath import NetPath
from kdn.server.nofile import raise_nofile
from kdn.server.observe import Metrics, RequestInterceptor
from kdn.server.service import KDNServicer, verify_entry
from kdn.server.tier_history import note_redis
from kdn.store.base import Tier
from kdn.store.lmdb import LmdbTier
from kdn.store.ram import RamTier
from kdn.store.redis import RedisTier
from kdn.store.tiered import TieredStore
from kdn.transport.addresses import host_port, is_loopback
from kdn.transport.buffers import SERVER_ARENAS, server_trim_bytes, tune_allocator
from kdn.transport.wire import serialize_passthrough, store_request
from kdn.v1 import kdn_pb2_grpc as pb_grpc

log = logging.getLogger("kdn.server")
SERVICE_NAME = "kdn.v1.KDN"


HEALTH_POLL_S = 0.25


class _FastFrames:
    """Registers the generated handler table with the frame codecs of ``kdn.transport.wire``:
    Retrieve's, RetrieveMany's and GetMany's serializers accept pre-encoded answers and Store's and
    StoreMany's deserializers read frames without copying them (the table stays the
    generated one)."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: object) -> None:
        pass  # registered below, once the table is patched

    def add_registered_method_handlers(self, name: str, table: dict[str, Any]) -> None:
        table = dict(table)
        table["Retrieve"] = table["Retrieve"]._replace(response_serializer=serialize_passthrough)
        table["RetrieveMany"] = table["RetrieveMany"]._replace(
            response_serializer=serialize_passthrough)
        table["GetMany"] = table["GetMany"]._replace(response_serializer=serialize_passthrough)
        table["Store"] = table["Store"]._replace(request_deserializer=store_request)
        table["StoreMany"] = table["StoreMany"]._replace(request_deserializer=store_request)
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, table),))
        self.server.add_registered_method_handlers(name, table)


def _tier(setting: str, make: Callable[[], Tier]) -> Tier:
    """``make()``; where that fails (an LMDB that does not open, a Redis Cluster or a budget
    no node takes, a URL redis-py refuses, or a query option of it redis-py's connections do
    not take: a TypeError) a ``ConfigError`` naming ``setting``, which ``kdn serve`` prints as
    one line; a disk tier's folder in use or its disk full are no configuration's fault and go
    on as they are."""
    try:
        return make()
    except (ConfigError, InUse, DiskFull):
        raise
    except (KDNError, ValueError) as exc:
        raise ConfigError(f"{setting}: {exc}") from exc
    except TypeError as exc:  # redis://h:p?socket_timeuot=1: a keyword no connection takes
        raise ConfigError(f"{setting}: an option it names is not taken: {exc}") from exc


def host_memory() -> int | None:
    """Bytes of memory this machine has, or its memory cgroup's limit where lower (a
    container, a pod); None where neither says."""
    try:
        sizes = [os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")]
    except (OSError, ValueError):
        sizes = []
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max", or v1's ~2**63: no limit
            sizes.append(int(text))
    return min(sizes) if sizes else None


def check_memory(config: ServerConfig) -> None:
    """Warn where ``ram_bytes``, with the wire memo and one tenant's read arena on top of it,
    is more than ``host_memory``: the RAM tier would not evict before the kernel kills the
    server (SIGKILL: MEMORY and write-behind entries lost), as ``fitted`` cuts a disk budget."""
    memory = host_memory()
    extra = min(config.wire_memo_bytes, config.ram_bytes // 4) \
        + min(config.shm_arena_bytes, config.ram_bytes // 4)  # (as KDNServicer takes them)
    if memory is not None and config.ram_bytes + extra > memory:
        log.warning("ram_bytes (%s, and %s for the wire memo and a tenant's read arena) is more "
                    "than this host's memory (%s): the kernel would kill the server before its "
                    "RAM tier evicts; lower ram_bytes", human_size(config.ram_bytes),
                    human_size(extra), human_size(memory))


def build_store(config: ServerConfig) -> TieredStore:
    """The tier hierarchy the config describes, in ``tier_order``; ``check_memory`` first."""
    check_memory(config)
    tiers: dict[str, Tier] = {"ram": RamTier(config.ram_bytes)}
    if config.redis_url:  # first: where it fails, no LMDB environment is left open
        tiers["redis"] = _tier("redis_url", partial(
            RedisTier, config.redis_urls, cluster=config.redis_cluster,
            part_bytes=config.redis_part_bytes, timeout_s=config.redis_timeout_s,
            retries=config.redis_retries, max_connections=config.redis_max_connections,
            capacity_bytes=config.redis_bytes, wait_replicas=config.redis_wait_replicas,
            wait_timeout_s=config.redis_wait_timeout_s))
    if config.disk_bytes:
        try:
            tiers["disk"] = _tier("data_dir", partial(LmdbTier, config.data_dir / "lmdb",
                                                      capacity_bytes=config.disk_bytes,
                                                      quiet_cut=config.disk_bytes
                                                      == DEFAULT_DISK_BYTES))
        except BaseException as exc:
            for tier in tiers.values():  # the RAM tier, a Redis tier's connections
                tier.close()
            if isinstance(exc, InUse):  # another server's disk tier (kdn.store.dirlock)
                raise InUse(f"data_dir {config.data_dir}: {exc}; give each kdn serve its own "
                            "--data-dir, or stop the one running") from None
            if isinstance(exc, DiskFull):
                raise DiskFull(f"data_dir {config.data_dir}: {exc}; free room there, or "
                               "give kdn serve another --data-dir") from None
            raise
    store = TieredStore(
        [tiers[name] for name in config.tier_order if name in tiers],
        verify=verify_entry, demote=config.demote_on_evict, write_policy=config.write_policy,
        queue_entries=config.write_queue_entries, queue_bytes=config.write_queue_bytes,
        default_ttl_s=config.default_ttl_s, flush_timeout_s=max(config.shutdown_grace_s, 1.0),
    )
    note_redis(store, config.redis_url)  # a Redis tier back after runs without it: named
    return store


async def _watch_health(store: TieredStore, servicer: health.aio.HealthServicer) -> None:
    """Mirror the store's tier health into the gRPC health service (see the module docstring)."""
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, \
        health_pb2.HealthCheckResponse.NOT_SERVING
    last: tuple[bool, bool] | None = None
    while True:
        state = (store.local_ok, store.degraded)
        if state != last:
            await servicer.set("", serving if state[0] else not_serving)
            await servicer.set(SERVICE_NAME, not_serving if state[1] else serving)
            if last is not None:  # a WARNING where it got worse, a recovery at INFO
                worse = (last[0] and not state[0]) or (state[1] and not last[1])
                log.log(logging.WARNING if worse else logging.INFO, "store health: local "
                        "tiers %s, %s", "ok" if state[0] else "DOWN",
                        "degraded" if state[1] else "all tiers up")
            last = state
        await asyncio.sleep(HEALTH_POLL_S)


def grpc_options(config: ServerConfig) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", config.max_message_bytes),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.so_reuseport", int(config.reuse_port)),
        # a client pings a connection it has waited on for 2 s or more (kdn.client.rpc.
        # KEEPALIVE_S): not a strike (gRPC's 5 minutes: GOAWAY on a long silent call)
        ("grpc.http2.min_ping_interval_without_data_ms", 1000),
        *([("grpc.max_connection_idle_ms", int(config.idle_timeout_s * 1000))]
          if config.idle_timeout_s else []),
        *([("grpc.max_connection_age_ms", int(config.max_connection_age_s * 1000)),
           ("grpc.max_connection_age_grace_ms", 30_000)] if config.max_connection_age_s else []),
        *([("grpc.max_allowed_incoming_connections", config.max_connections)]
          if config.max_connections else []),
        *([("grpc.server_handshake_timeout_ms", int(config.handshake_timeout_s * 1000))]
          if config.handshake_timeout_s else []),
        *([("grpc.max_concurrent_streams", config.max_streams_per_connection)]
          if config.max_streams_per_connection else []),
    ]


PORT_TAKEN = ("is another process (another kdn serve?) on that port? pick another with --port, "
              "or set reuse_port to share it on purpose")
PORT_NOT_SHARED = ("another process holds that port and does not share it (reuse_port shares a "
                   "port only among processes of one user that all set it, as kdn serve with "
                   "reuse_port: true does); pick another with --port, or stop that process")


def _taken(reuse_port: bool) -> str:
    return PORT_NOT_SHARED if reuse_port else PORT_TAKEN


def bind_problem(host: str, port: int, reuse_port: bool = False) -> str | None:
    """Why gRPC could not listen on ``host:port``, found by binding a socket as gRPC does
    (SO_REUSEADDR, and SO_REUSEPORT for ``reuse_port``) on each of the host's addresses:
    another process listens on the port on one of them (``PORT_TAKEN``; with ``reuse_port``,
    one that does not share it: ``PORT_NOT_SHARED``), the host does not resolve, or none of
    its addresses is one of this machine's; None where a bind works."""
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return (f"the host {host!r} does not resolve ({exc.strerror or exc}); give an address "
                "of this machine with --host (127.0.0.1; 0.0.0.0 for all)")
    foreign = []
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if reuse_port:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    return _taken(reuse_port)
                if exc.errno == errno.EADDRNOTAVAIL:
                    foreign.append(str(addr[0]))
    if foreign and len(foreign) == len(infos):  # gRPC listens where any of them binds
        return (f"{', '.join(foreign)} is not an address of this machine; give one of its "
                "addresses with --host (127.0.0.1; 0.0.0.0 for all)")
    return None


def _listen(server: grpc.aio.Server, config: ServerConfig,
            creds: grpc.ServerCredentials | None) -> int:
    """Bind the port; a host or port that can not be bound is a one-line error naming it."""
    why = f"can not listen on {config.address}: "
    problem = bind_problem(config.host, config.port, config.reuse_port)
    if problem:
        raise OSError(why + problem)  # found before gRPC's own attempt, which logs a native line
    try:
        port = (server.add_secure_port(config.address, creds) if creds is not None
                else server.add_insecure_port(config.address))
    except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
        raise OSError(why + _taken(config.reuse_port)) from exc
    if port == 0:
        raise OSError(why + _taken(config.reuse_port))
    return int(port)


REFLECTED = ("kdn.v1.KDN", "kdn.v1.KDNAdmin", "grpc.health.v1.Health")
"""The services gRPC server reflection lists (grpcurl, Evans and Postman find them there)."""


@dataclass
class Server:
    config: ServerConfig
    grpc_server: grpc.aio.Server
    store: TieredStore
    servicer: KDNServicer
    health: health.aio.HealthServicer
    port: int
    health_task: asyncio.Task[None] | None = None
    metrics: Metrics | None = None
    metrics_port: int = -1
    admin: AdminServicer | None = None
    fast_path: FastPath | None = None
    net_path: NetPath | None = None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        return host_port(self.config.host, self.port)

    async def wait(self) -> None:
        await self._stopped.wait()

    async def stop(self, grace: float | None = None) -> None:
        if self._stopped.is_set():
            return
        if self.health_task is not None:
            self.health_task.cancel()
        await self.health.enter_graceful_shutdown()
        grace = self.config.shutdown_grace_s if grace is None else grace
        paths = [p for p in (self.fast_path, self.net_path) if p is not None]
        for path in paths:  # no new call on any path; those in flight are answered in the grace
            path.stop_accepting()
        await asyncio.gather(self.grpc_server.stop(grace),
                             *(asyncio.to_thread(path.drain, grace) for path in paths))
        for path in paths:
            path.close()
        self.servicer.segments.close()
        self.servicer.arenas.close()
        self.servicer.heap.close()
        await asyncio.to_thread(self.store.close)
        if self.metrics is not None:
            self.metrics.close()
        self._stopped.set()
        log.info("kdn server on %s stopped", self.address)


def check_tls_files(config: ServerConfig) -> None:
    """Load the certificate, its key and the client CA as a TLS library would, so that a
    wrong pair, an encrypted key or a damaged file stops the start with a sentence naming the
    file (gRPC would only say that it failed to bind)."""
    import ssl

    if not config.tls_cert:
        return
    files = {"tls_cert": config.tls_cert, "tls_key": config.tls_key,
             "tls_client_ca": config.tls_client_ca}
    for name, marker, what in (("tls_cert", b"-----BEGIN CERTIFICATE-----", "certificate"),
                               ("tls_key", b"PRIVATE KEY-----", "private key"),
                               ("tls_client_ca", b"-----BEGIN CERTIFICATE-----", "certificate")):
        if files[name] and marker not in Path(files[name]).read_bytes():
            raise ConfigError(f"{name} {files[name]}: holds no PEM {what} (-----BEGIN "
                              f"{what.upper()}-----)")

    def encrypted() -> bytes:
        raise ConfigError(f"tls_key {config.tls_key}: the key is encrypted (it has a "
                          "passphrase), which the server can not use; write it out without "
                          "one (openssl pkey -in KEY -out KEY.plain) and chmod 600 it")

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key, password=encrypted)
    except ssl.SSLError as exc:
        what = ("is not the private key of the certificate in tls_cert "
                f"{config.tls_cert}" if "KEY_VALUES_MISMATCH" in str(exc) else
                f"and tls_cert {config.tls_cert} are not a usable PEM certificate and key "
                f"({exc.reason or exc})")
        raise ConfigError(f"tls_key {config.tls_key} {what}") from None
    if config.tls_client_ca:
        try:
            ctx.load_verify_locations(config.tls_client_ca)
        except ssl.SSLError as exc:
            raise ConfigError(f"tls_client_ca {config.tls_client_ca}: not a PEM CA bundle "
                              f"({exc.reason or exc})") from None


def data_path_tls(config: ServerConfig) -> ssl.SSLContext | None:
    """The network data path's TLS: the gRPC listener's certificate and key (None without
    them). No client certificate is asked for there: a call names a ticket, which only a
    caller authenticated over gRPC (by its certificate too, under mutual TLS) was given."""
    if not config.tls_cert:
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(config.tls_cert, config.tls_key)
    return ctx


def _credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    if not config.tls_cert:
        return None
    check_tls_files(config)
    ca = Path(config.tls_client_ca).read_bytes() if config.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(Path(config.tls_key).read_bytes(), Path(config.tls_cert).read_bytes())],
        root_certificates=ca, require_client_auth=ca is not None)


async def start_server(config: ServerConfig, store: TieredStore | None = None,
                       blender: Blender | None = None) -> Server:
    """Start listening; ``blender`` (the model side of the Blend RPC) makes it blend. What can
    be refused is refused before the store opens (a store opened here is closed again when the
    start fails later, e.g. on a port another process holds)."""
    if config.tracing and not tracing.enable():
        raise ConfigError("tracing: needs the opentelemetry-api package (pip install "
                          "'kdn[tracing]')")
    # received Store messages must not fault in fresh pages, nor those of a Store kept as its
    # messages once the entry it replaced is freed (kdn.transport.buffers)
    tune_allocator(server_trim_bytes(config.ram_bytes))
    creds = _credentials(config)
    auth = Authenticator(load_auth(config.auth_file) if config.auth_file else
                         tenants_from_text(config.auth_tenants) if config.auth_tenants else
                         AuthConfig(),
                         mtls=bool(config.tls_client_ca),
                         mtls_role=None if config.mtls_role == "none" else Role(config.mtls_role))
    if not auth.mtls and (unasked := certificates_unasked(auth.config)):
        log.warning("subjects of tenants %s go unused: this server asks no client certificate "
                    "(no tls_client_ca), so they enter by API key only", ", ".join(unasked))
    if not is_loopback(config.host):
        if auth.enabled and not config.tls_cert and config.insecure:
            log.warning("insecure: API keys travel in plaintext to %s:%d (auth on, TLS off); "
                        "anyone on the network path can read them", config.host, config.port)
        elif auth.open:
            log.warning("no authentication on %s:%d (no auth_file, no mutual TLS): whoever "
                        "reaches the port is an admin of every entry", config.host, config.port)
    own_store = store is None
    store = store or build_store(config)
    try:
        return await _start(config, store, auth, creds, blender)
    except BaseException:
        if own_store:
            await asyncio.to_thread(store.close)
        raise


async def _start(config: ServerConfig, store: TieredStore, auth: Authenticator,
                 creds: grpc.ServerCredentials | None, blender: Blender | None) -> Server:
    await asyncio.to_thread(recount_usage, store, auth)
    store.on_back.append(lambda _: auth.usage_whole or recount_usage(store, auth))  # counted
    # with a tier down (here or by a Gc): counted again once none is
    servicer = KDNServicer(config, store, auth)
    servicer.blender = blender
    admin = AdminServicer(store, auth, servicer.arenas, servicer.ingest, servicer.counters,
                          servicer.egress)
    metrics = Metrics(lambda: {
        "tiers": store.stats(), "queues": store.queue_depth(),
        "counters": {**servicer.counters.snapshot(),
                     **{f"store.{k}": v for k, v in store.counters.items()}},
        "usage": servicer.usage, "in_flight": servicer.in_flight + admin.in_flight,
    })
    server = grpc.aio.server(options=grpc_options(config), interceptors=[RequestInterceptor(
        auth, metrics, idle_s=config.idle_timeout_s, open_s=config.handshake_timeout_s)])
    pb_grpc.add_KDNServicer_to_server(servicer, _FastFrames(server))
    pb_grpc.add_KDNAdminServicer_to_server(admin, server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    from grpc_reflection.v1alpha import reflection

    reflection.enable_server_reflection((*REFLECTED, reflection.SERVICE_NAME), server)
    port = _listen(server, config, creds)
    await server.start()
    fast_path = FastPath(servicer,  # same-host GetMany / PutMany without gRPC
                         first_call_s=config.handshake_timeout_s)
    net_path: NetPath | None = None
    try:
        servicer.fast_path_name = fast_path.name
        if config.data_port >= 0:  # other hosts' GetMany / PutMany
            net_path = NetPath(servicer, config.host, config.data_port, data_path_tls(config),
                               idle_s=config.idle_timeout_s,
                               first_call_s=config.handshake_timeout_s)
            servicer.data_port = net_path.port
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        metrics_port = -1
        if config.metrics_port >= 0:
            metrics_port = metrics.serve_http(config.metrics_host, config.metrics_port,
                                              request_s=config.handshake_timeout_s)
    except BaseException:
        fast_path.close()
        if net_path is not None:
            net_path.close()
        servicer.segments.close()
        servicer.arenas.close()
        servicer.heap.close()
        await server.stop(0)
        raise
    task = asyncio.ensure_future(_watch_health(store, health_servicer))
    log.info("kdn server listening on %s (tiers: %s; tls: %s; auth: %s; metrics: %s; "
             "data path: %s)", host_port(config.host, port), ", ".join(t.name for t in store.tiers),
             "mutual" if config.tls_client_ca else ("on" if creds else "off"),
             "on" if auth.enabled else "off",
             f"{config.metrics_host}:{metrics_port}" if metrics_port >= 0 else "off",
             f"tcp port {net_path.port}" if net_path is not None else "off")
    return Server(config, server, store, servicer, health_servicer, port, task, metrics,
                  metrics_port, admin, fast_path, net_path)


def _stopping(server: Server, sig: signal.Signals) -> None:
    """A graceful stop on SIGINT, SIGTERM and SIGHUP (a closing terminal's; it killed the
    server outright). SIGHUP reloads nothing: the tenants file's keys also live on in
    segments, tickets and egress caps made from it, so it is read at start only."""
    if sig is signal.SIGHUP:
        log.warning("SIGHUP: stopping gracefully (the tenants file is read at start only: a "
                    "restart reloads it)")
    asyncio.ensure_future(server.stop())


async def serve(config: ServerConfig, blender: Blender | None = None) -> None:
    if config.tracing:  # kdn serve's process: the provider OTEL_TRACES_EXPORTER names
        tracing.enable(from_env=True)
    # a process of its own: its heaps are capped (an engine's process embedding a server,
    # ServerThread, keeps glibc's for its own threads)
    tune_allocator(server_trim_bytes(config.ram_bytes), SERVER_ARENAS)
    raise_nofile(config)  # (its own process's limit too: a connection is a descriptor)
    server = await start_server(config, blender=blender)
    gc.freeze()  # what start-up made lives as long as the process: no collection scans it
    where = "no disk tier"
    for tier in server.store.tiers:
        if isinstance(tier, LmdbTier):  # its budget as taken: cut where the disk holds less
            where = f"data in {config.data_dir}, up to {human_size(tier.capacity_bytes)}"
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # before the ready line: a
        loop.add_signal_handler(sig, _stopping, server, sig)  # supervisor may stop it at once
    print(f"kdn serving on {server.address} ({where})", flush=True)  # once it reads the line
    await server.wait()


class ServerThread:
    """A server on its own event loop in a daemon thread; ``with ServerThread(cfg) as s:``.
    The loop is closed once the server stopped (or failed to start): nothing of it stays."""

    def __init__(self, config: ServerConfig, store: TieredStore | None = None) -> None:
        self.config = config
        self._store = store
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.server: Server | None = None
        self._thread = threading.Thread(target=self._run, name="kdn-server", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            try:
                self.server = self._loop.run_until_complete(start_server(self.config,
                                                                         self._store))
            except BaseException as exc:  # reported to the starting thread
                self._error = kept(exc)  # not this frame, which holds ``self``
                self._ready.set()
                return
            self._ready.set()
            self._loop.run_until_complete(self.server.wait())
        finally:  # its selector's descriptors, and the thread of its to_thread calls, go
            self._loop.close()

    def start(self) -> ServerThread:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise again(self._error)  # a copy: its traceback holds this frame, and ``self``
        return self

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def stop(self, grace: float | None = None) -> None:
        if self.server is not None and self._thread.is_alive():
            fut = asyncio.run_coroutine_threadsafe(self.server.stop(grace), self._loop)
            fut.result(timeout=60)
        self._thread.join(timeout=60)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
