"""``kdn`` command line: ``kdn serve``, ``kdn admin ...`` and ``kdn rag ...``.

Conventions (as kubectl's): options go anywhere after their command group (``kdn admin stats
--json`` and ``kdn admin --json stats`` are the same), every command that prints takes
``-o json|table`` (``--json`` is ``-o json``), JSON keeps types (counters are numbers), and
exit codes say what happened (``EXIT_CODES``). A user's mistake is one line on stderr that says
what to do, never a traceback. Building the parser imports neither grpc nor torch: the
commands import what they need when they run, so ``kdn --help`` is fast.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, NoReturn

from kdn.cli.args import (
    add_output_options,
    address,
    check_environment,
    count,
    key_or_prefix,
    model_problem,
    positive,
)
from kdn.cli.output import (
    dump_json,
    error,
    fields,
    human_age,
    human_size,
    message_dict,
    short_key,
    table,
)
from kdn.errors import (
    DeadlineExceeded,
    KDNError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
EXIT_CODES = """\
exit codes:
  0  ok
  1  the command ran and found a failure: the server is unreachable or answered an error,
     an entry is absent, verify found corrupt entries, health: the server is not SERVING
     (with --ready: a service or tier is not), an export or import file is damaged
  2  usage: an unknown command or option, a malformed value (an address without a port, an
     ambiguous key prefix), a missing file, state folder or model, a bad configuration or a
     misspelt KDN_* variable"""
DEFAULT_ADDRESS = "127.0.0.1:50051"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs keep their lines (examples, exit codes); option help is wrapped."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser with a usage error on one line (``kdn admin ls: argument --limit:
    ...; see kdn admin ls --help``), exit code 2, instead of the usage block."""

    def error(self, message: str) -> NoReturn:
        error(self.prog, message, f"see {self.prog} --help")
        sys.exit(EXIT_USAGE)

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """Arguments a command does not know are refused by that command's parser, which
        names it (``kdn admin stats: unrecognized arguments: --bogus``), not by ``kdn``'s."""
        ns, extra = super().parse_known_args(args, namespace)
        if extra:
            self.error(f"unrecognized arguments: {' '.join(extra)}")
        return ns, extra


def _epilog(examples: list[str]) -> str:
    return "examples:\n" + "\n".join(f"  {e}" for e in examples) + "\n\n" + EXIT_CODES


# ------------------------------------------------------------------------------- options


def _admin_options(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    def default(value: Any) -> Any:
        return argparse.SUPPRESS if suppress else value

    g = p.add_argument_group("connection")
    g.add_argument("--address", type=address,
                   default=default(os.environ.get("KDN_ADDRESS", DEFAULT_ADDRESS)),
                   help=f"server host:port (default: $KDN_ADDRESS or {DEFAULT_ADDRESS})")
    g.add_argument("--timeout", type=positive, default=default(30.0),
                   help="seconds per call (default: 30)")
    g.add_argument("--api-key", default=default(None), help="API key (default: $KDN_API_KEY)")
    g.add_argument("--tls-ca", default=default(None), help="PEM CA to trust (enables TLS)")
    g.add_argument("--tls-cert", default=default(None), help="client certificate (mutual TLS)")
    g.add_argument("--tls-key", default=default(None), help="client private key (mutual TLS)")
    g.add_argument("--tls-server-name", default=default(None),
                   help="expected server certificate name")
    g.add_argument("--insecure", action="store_true", default=default(False),
                   help="send the API key even over plaintext to a non-loopback server "
                        "(default: $KDN_INSECURE=1, else refused)")
    add_output_options(p, suppress=suppress)


# ------------------------------------------------------------------------------- serve


def _serve(ns: argparse.Namespace) -> int:
    from kdn.errors import ConfigError
    from kdn.server.config import describe, load_config

    flags = {name: getattr(ns, name, None) for name, _, _ in describe()}
    try:
        config = load_config(ns.config, flags=flags)
    except ConfigError as exc:
        error("kdn serve", f"bad configuration: {exc}", "see kdn serve --help")
        return EXIT_USAGE
    if config.model and (why := model_problem(config.model)):
        error("kdn serve", why)
        return EXIT_USAGE

    import asyncio

    from kdn.server.app import serve
    from kdn.server.logs import configure

    configure(config.log_level, config.log_format)
    blender = None
    if config.model:  # the model side of the Blend RPC; the model loads on the first Blend
        from kdn.blend.host import ModelBlender

        blender = ModelBlender(name=config.model)
    try:
        asyncio.run(serve(config, blender))
    except ConfigError as exc:  # found at start-up: TLS files that do not make a pair, ...
        error("kdn serve", f"bad configuration: {exc}")
        return EXIT_USAGE
    except OSError as exc:  # a port taken, a data folder that can not be written
        error("kdn serve", f"{exc.filename}: {exc.strerror}" if exc.filename
              else exc.strerror or str(exc))
        return EXIT_FAILED
    return EXIT_OK


# ------------------------------------------------------------------------------- admin


def _admin_client(ns: argparse.Namespace) -> Any:
    from kdn.client.admin import AdminClient
    from kdn.client.client import TLSOptions

    tls = None
    if ns.tls_ca or ns.tls_cert or ns.tls_key:
        def read(p: str | None) -> bytes | None:
            return Path(p).read_bytes() if p else None

        tls = TLSOptions(ca=read(ns.tls_ca), cert=read(ns.tls_cert), key=read(ns.tls_key),
                         server_name=ns.tls_server_name or "")
    return AdminClient(ns.address, timeout_s=ns.timeout,
                       api_key=ns.api_key or os.environ.get("KDN_API_KEY") or None, tls=tls,
                       shm_bytes=0, insecure=ns.insecure or None)


class UsageError(Exception):
    """A mistake found after parsing (an ambiguous key prefix): one line, exit 2."""


def resolve(client: Any, text: str, namespace: str, tenant: str = "") -> bytes:
    """The key ``text`` names in ``namespace`` (of ``tenant``: admins): itself when whole (64
    hex digits), else the one stored key it is a prefix of (as git's short hashes; an admin's
    listing without a tenant shows the same key once per tenant). No match: NotFound (exit 1);
    several: a UsageError naming them (exit 2)."""
    from kdn.names import KEY_BYTES

    if len(text) == 2 * KEY_BYTES:
        return bytes.fromhex(text)
    found: list[str] = []
    for e in client.ls(namespace, bytes.fromhex(text[: len(text) // 2 * 2]), tenant=tenant,
                       limit=16):
        if e.key.hex().startswith(text) and e.key.hex() not in found:
            found.append(e.key.hex())
        if len(found) > 3:
            break
    if not found:
        raise NotFound(f"no entry whose key starts with {text} in namespace {namespace!r}")
    if len(found) > 1:
        raise UsageError(f"key prefix {text} is ambiguous in namespace {namespace!r}: "
                         f"{', '.join(found[:3])}{', ...' if len(found) > 3 else ''}; "
                         "give more digits")
    return bytes.fromhex(found[0])


def _keys(client: Any, ns: argparse.Namespace) -> list[bytes]:
    return [resolve(client, k, ns.namespace, ns.tenant) for k in ns.keys]


def _entry(info: Any) -> dict[str, Any]:
    """An ``EntryInfo`` as typed JSON (``age_seconds`` null when the server does not know)."""
    d = message_dict(info)
    d["age_seconds"] = None if info.age_seconds < 0 else round(info.age_seconds, 3)
    return d


def _codec(d: dict[str, Any]) -> str:
    return f"{d['codec_mode']}-{d['codec_level']}" if d["codec_level"] else d["codec_mode"]


def _stats(client: Any, ns: argparse.Namespace) -> int:
    d = message_dict(client.stats())
    if ns.output == "json":
        dump_json(d)
        return EXIT_OK
    tiers = [{**t, "size": human_size(t["bytes"]), "capacity": human_size(t["capacity_bytes"])}
             for t in d["tiers"]]
    table(tiers, ["name", "entries", "size", "capacity", "hits", "misses", "evictions",
                  "corrupt", "healthy"], empty="(no tiers)")
    if d["tenants"]:
        print()
        table([{**t, "size": human_size(t["bytes"]),
                "quota": human_size(t["quota_bytes"]) if t["quota_bytes"] else "-"}
               for t in d["tenants"]], ["tenant", "entries", "size", "quota"])
    print()
    fields([("version", d["version"]), ("health", d["health"]), *d["counters"].items()])
    return EXIT_OK


def _health(client: Any, ns: argparse.Namespace) -> int:
    report = client.health_report()
    if ns.output == "json":
        dump_json(report)
    else:
        rows = [{"name": "(server)", "kind": "server", "status": report["server"]}]
        rows += [{"name": n, "kind": "service", "status": s}
                 for n, s in report["services"].items()]
        down = report["parts_down"] or {}
        rows += [{"name": n, "kind": "tier", "status": s,
                  "not_answering": ", ".join(down.get(n, [])) or None}
                 for n, s in (report["tiers"] or {}).items()]
        table(rows, ["name", "kind", "status", "not_answering"])
    if ns.ready:  # readiness: every service and tier SERVING
        return EXIT_OK if report["status"] == "SERVING" else EXIT_FAILED
    return EXIT_OK if report["server"] == "SERVING" else EXIT_FAILED  # liveness


def _lookup(client: Any, ns: argparse.Namespace) -> int:
    keys: list[bytes | None] = []
    for k in ns.keys:  # a prefix that matches nothing is an absent entry here, not an error
        try:
            keys.append(resolve(client, k, ns.namespace))
        except NotFound:
            keys.append(None)
    res = client.lookup([k for k in keys if k is not None], namespace=ns.namespace)
    infos = iter(res.infos)
    rows: list[dict[str, Any]] = []
    for text, k in zip(ns.keys, keys):
        i = next(infos) if k is not None else None
        present = bool(i is not None and i.present)
        rows.append({"key": k.hex() if k is not None else text, "present": present,
                     "tier": (i.tier or None) if i is not None else None,
                     "size_bytes": i.size_bytes if i is not None and present else None})
    if ns.output == "json":
        dump_json(rows)
    else:
        table([{**r, "size": human_size(r.pop("size_bytes"))} for r in rows],
              ["key", "present", "tier", "size"])
    return EXIT_OK if all(r["present"] for r in rows) else EXIT_FAILED


def _counted(what: str, n: int, ns: argparse.Namespace) -> int:
    if ns.output == "json":
        dump_json({what: n})
    else:
        print(f"{what}: {n}")
    return EXIT_OK if n else EXIT_FAILED


def _delete(client: Any, ns: argparse.Namespace) -> int:
    return _counted("deleted", client.delete(_keys(client, ns), namespace=ns.namespace,
                                             tenant=ns.tenant), ns)


def _evict(client: Any, ns: argparse.Namespace) -> int:
    return _counted("evicted", client.evict(_keys(client, ns), ns.namespace, ns.tier,
                                            tenant=ns.tenant), ns)


def _pin(client: Any, ns: argparse.Namespace) -> int:
    return _counted("pinned", client.pin(_keys(client, ns), ns.namespace, tenant=ns.tenant), ns)


def _unpin(client: Any, ns: argparse.Namespace) -> int:
    return _counted("unpinned", client.unpin(_keys(client, ns), ns.namespace, tenant=ns.tenant),
                    ns)


def _ls(client: Any, ns: argparse.Namespace) -> int:
    import itertools

    listed = client.ls(ns.namespace, bytes.fromhex(ns.prefix), ns.model, ns.tenant,
                       min(ns.limit, 1000) if ns.limit else 0)
    entries = [_entry(e) for e in (itertools.islice(listed, ns.limit) if ns.limit else listed)]
    for e in entries:
        e.pop("layout")  # Inspect only
    if ns.output == "json":
        dump_json(entries)
        return EXIT_OK
    rows = [{"namespace": e["namespace"], "key": short_key(e["key"]), "tenant": e["tenant"],
             "model": _model(e), "codec": _codec(e),
             "tokens": e["tokens"], "size": human_size(e["size_bytes"]), "tiers": e["tiers"],
             "pinned": e["pinned"], "age": human_age(e["age_seconds"])} for e in entries]
    table(rows, empty="(no entries)")
    return EXIT_OK


def _model(e: dict[str, Any]) -> str:
    """The table's model cell: the stored name's last path part (a writer's local folder
    shows as the model's name), else the fingerprint's first digits."""
    name = str(e["model_name"]).rstrip("/").rsplit("/", 1)[-1]
    return name or str(e["model_fingerprint"])[:12]


def _inspect(client: Any, ns: argparse.Namespace) -> int:
    e = _entry(client.inspect(resolve(client, ns.key, ns.namespace, ns.tenant), ns.namespace,
                              tenant=ns.tenant))
    if ns.output == "json":
        dump_json(e)
        return EXIT_OK
    layers = (e["layout"] or {}).get("layers", [])
    fields([("namespace", e["namespace"]), ("key", e["key"]), ("tenant", e["tenant"]),
            ("model", e["model_name"]), ("model_fingerprint", e["model_fingerprint"]),
            ("layout_fingerprint", e["layout_fingerprint"]), ("codec", _codec(e)),
            ("dtype", e["dtype"]), ("layers", e["num_layers"]), ("tokens", e["tokens"]),
            ("size", f"{human_size(e['size_bytes'])} ({e['size_bytes']} bytes)"),
            ("tiers", e["tiers"]), ("pinned", e["pinned"]),
            ("age", human_age(e["age_seconds"])),
            ("kv_heads", sorted({x["kv_heads"] for x in layers})),
            ("k_channels", [x["k_channels"] for x in layers]),
            ("v_channels", [x["v_channels"] for x in layers])])
    return EXIT_OK


def _verify(client: Any, ns: argparse.Namespace) -> int:
    report: dict[str, dict[str, Any]] = {}
    for p in client.verify(dry_run=ns.dry_run):
        t = report.setdefault(p.tier, {"scanned": 0, "corrupt": 0, "removed": 0,
                                       "corrupt_keys": []})
        t.update(scanned=int(p.scanned), corrupt=int(p.corrupt), removed=int(p.removed))
        t["corrupt_keys"] += list(p.corrupt_keys)
    if ns.output == "json":
        dump_json(report)
    else:
        table([{"tier": name, **{k: v for k, v in t.items() if k != "corrupt_keys"}}
               for name, t in report.items()], ["tier", "scanned", "corrupt", "removed"],
              empty="(no tiers)")
        for name, t in report.items():
            for k in t["corrupt_keys"]:
                print(f"corrupt in {name}: {k}")
    return EXIT_FAILED if any(t["corrupt"] for t in report.values()) else EXIT_OK


def _progress(desc: str, ns: argparse.Namespace) -> Any:
    """A tqdm bar on stderr, only on a terminal and for table output."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="entry",
               disable=ns.output == "json" or not sys.stderr.isatty())

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    update.close = bar.close  # type: ignore[attr-defined]
    return update


def _export(client: Any, ns: argparse.Namespace) -> int:
    bar = _progress("export", ns)
    try:
        n = client.export_to(Path(ns.file), ns.namespace, bytes.fromhex(ns.prefix),
                             progress=bar, tenant=ns.tenant)
    finally:
        bar.close()
    if ns.output == "json":
        dump_json({"file": ns.file, "entries": n})
    else:
        fields([("file", ns.file), ("entries", n)])
    return EXIT_OK


def _import(client: Any, ns: argparse.Namespace) -> int:
    if Path(ns.file).is_dir():
        raise IsADirectoryError(21, "is a directory, not an export file", ns.file)
    if not Path(ns.file).is_file():
        raise FileNotFoundError(2, "no such file", ns.file)
    bar = _progress("import", ns)
    try:
        resp = client.import_from(Path(ns.file), progress=bar)
    finally:
        bar.close()
    d = message_dict(resp)
    dump_json(d) if ns.output == "json" else fields(d.items())
    return EXIT_FAILED if resp.rejected else EXIT_OK


def _gc(client: Any, ns: argparse.Namespace) -> int:
    d = message_dict(client.gc())
    dump_json(d) if ns.output == "json" else fields(d.items())
    return EXIT_OK


def _fleet_nodes(ns: argparse.Namespace) -> list[str]:
    """The fleet's addresses: --nodes, else --fleet-file's ``nodes:``, else $KDN_FLEET."""
    if ns.nodes:
        return [a.strip() for arg in ns.nodes for a in arg.split(",") if a.strip()]
    if ns.fleet_file:
        from kdn.client.fleet import FleetConfig

        return list(FleetConfig.from_file(Path(ns.fleet_file)).nodes)
    return [a.strip() for a in os.environ.get("KDN_FLEET", "").split(",") if a.strip()]


def _fleet(ns: argparse.Namespace) -> int:
    """Every node of a fleet: health, RAM hit ratio, bytes, load (``kdn.client.fleet``)."""
    from kdn.client.fleet import fleet_view
    from kdn.errors import ConfigError

    prog = "kdn admin fleet"
    try:
        nodes = _fleet_nodes(ns)
    except ConfigError as exc:
        error(prog, exc)
        return EXIT_USAGE
    if not nodes:
        error(prog, "no nodes given", "pass --nodes HOST:PORT,... or --fleet-file FILE, or "
              "set $KDN_FLEET")
        return EXIT_USAGE
    bad = [a for a in nodes if not a.rpartition(":")[2].isdigit()]
    if bad:
        error(prog, f"not host:port: {', '.join(bad)}")
        return EXIT_USAGE
    rows = fleet_view(nodes, timeout_s=ns.timeout,
                      api_key=ns.api_key or os.environ.get("KDN_API_KEY") or None,
                      insecure=ns.insecure or None)
    if ns.output == "json":
        dump_json(rows)
    else:
        table([{**r, "ram_size": human_size(r["ram_bytes"])} for r in rows],
              ["node", "status", "ram_entries", "ram_size", "ram_hit_ratio", "redis_hits",
               "in_flight", "error"])
    return EXIT_OK if all(r["status"] == "SERVING" for r in rows) else EXIT_FAILED


ADMIN = {"stats": _stats, "health": _health, "lookup": _lookup, "delete": _delete,
         "evict": _evict, "pin": _pin, "unpin": _unpin, "ls": _ls, "inspect": _inspect,
         "verify": _verify, "export": _export, "import": _import, "gc": _gc}


def _hint(exc: KDNError, ns: argparse.Namespace) -> str:
    if isinstance(exc, Unavailable):
        return f"is a kdn server listening on {ns.address}? (set --address or $KDN_ADDRESS)"
    if isinstance(exc, DeadlineExceeded):
        return "the server did not answer in time; raise --timeout"
    if isinstance(exc, Unauthenticated):
        return "pass --api-key or set $KDN_API_KEY"
    if isinstance(exc, PermissionDenied):
        return "this command needs an API key of the admin role"
    return ""


def _admin(ns: argparse.Namespace) -> int:
    prog = f"kdn admin {ns.admin_cmd}"
    if not check_environment(prog):
        return EXIT_USAGE
    if ns.admin_cmd == "fleet":  # many nodes, each with its own client
        try:
            return _fleet(ns)
        except KDNError as exc:  # an API key that would travel in plaintext
            error(prog, exc, "or pass --insecure")
            return EXIT_USAGE
    try:
        client = _admin_client(ns)
    except OSError as exc:  # a TLS file that can not be read
        error(prog, f"{exc.filename}: {exc.strerror}", "check the --tls-* paths")
        return EXIT_USAGE
    except KDNError as exc:  # an API key that would travel in plaintext
        error(prog, exc, "or pass --insecure")
        return EXIT_USAGE
    try:
        return int(ADMIN[ns.admin_cmd](client, ns))
    except UsageError as exc:
        error(prog, exc)
        return EXIT_USAGE
    except NotFound as exc:
        error(prog, exc)
        return EXIT_FAILED
    except KDNError as exc:
        error(prog, exc, _hint(exc, ns))
        return EXIT_FAILED
    except BrokenPipeError:
        raise  # main's: a reader that left is no error of this command
    except OSError as exc:  # the export/import file
        error(prog, f"{exc.filename}: {exc.strerror}" if exc.filename else str(exc))
        return EXIT_USAGE
    finally:
        client.close()


# ------------------------------------------------------------------------------- parser


ADMIN_EXAMPLES = [
    "kdn admin health                      # liveness: exit 1 only when the server is not up",
    "kdn admin health --ready              # readiness: exit 1 while a service or tier is down",
    "kdn admin stats --json",
    "kdn admin ls --namespace kb --limit 20",
    "kdn admin inspect KEY --namespace kb",
    "kdn admin lookup KEY --namespace kb -o json",
    "kdn admin verify --dry-run",
    "kdn admin export kb.kdnx --namespace kb",
    "kdn admin import kb.kdnx --address 10.0.0.7:50051",
    "kdn admin fleet --nodes 10.0.0.1:50051 10.0.0.2:50051 # per node: health, hits, load",
]
SERVE_EXAMPLES = [
    "kdn serve",
    "kdn serve --port 50052 --data-dir /var/lib/kdn --ram-bytes 4GiB",
    "kdn serve --redis-url redis://127.0.0.1:6379 --tier-order ram,redis,disk",
]
TOP_EXAMPLES = [
    "kdn serve --ram-bytes 1GiB --disk-bytes 16GiB",
    "kdn admin health",
    "kdn admin stats -o json",
    "kdn rag ingest docs/ --state .kdn-rag",
]


COMMAND_EXAMPLES = {
    "stats": ["kdn admin stats", "kdn admin stats -o json"],
    "health": ["kdn admin health", "kdn admin health --ready --address 127.0.0.1:50051"],
    "lookup": ["kdn admin lookup KEY --namespace kb",
               "kdn admin lookup KEY KEY --namespace kb -o json"],
    "delete": ["kdn admin delete KEY --namespace kb"],
    "evict": ["kdn admin evict KEY --namespace kb --tier ram"],
    "pin": ["kdn admin pin KEY --namespace kb"],
    "unpin": ["kdn admin unpin KEY --namespace kb"],
    "ls": ["kdn admin ls --namespace kb --limit 20", "kdn admin ls --model smollm2-135m",
           "kdn admin ls --prefix 3f -o json"],
    "inspect": ["kdn admin inspect KEY --namespace kb"],
    "verify": ["kdn admin verify --dry-run"],
    "export": ["kdn admin export kb.kdnx --namespace kb   # run again to resume"],
    "import": ["kdn admin import kb.kdnx"],
    "gc": ["kdn admin gc"],
    "fleet": ["kdn admin fleet --nodes 10.0.0.1:50051 10.0.0.2:50051 -o json"],
}
"""Each ``kdn admin COMMAND --help`` ends with these (KEY: a key or a unique prefix of one);
a test runs every one against a live server."""
TIERS = ("ram", "redis", "disk")


def _add_admin(sub: Any) -> None:
    from kdn.cli.args import HEX_PREFIX, NAMESPACE, NAMESPACE_FILTER, TENANT_FILTER

    common = _Parser(add_help=False)
    _admin_options(common, suppress=True)
    admin = sub.add_parser("admin", help="operate a running server", formatter_class=_Formatter,
                           description="Operate a running kdn server (the KDNAdmin service).",
                           epilog=_epilog(ADMIN_EXAMPLES))
    _admin_options(admin, suppress=False)
    asub = admin.add_subparsers(dest="admin_cmd", required=True, metavar="COMMAND")

    def command(name: str, hlp: str) -> argparse.ArgumentParser:
        return asub.add_parser(name, help=hlp, description=hlp[0].upper() + hlp[1:] + ".",
                               parents=[common], formatter_class=_Formatter,
                               epilog=_epilog(COMMAND_EXAMPLES[name]))

    command("stats", "per-tier entries, bytes, hit rates; per tenant; counters")
    command("health", "the server, the kdn.v1.KDN service and every tier: SERVING or not "
            "(exit 1: the server is not serving; with --ready: any of them)").add_argument(
        "--ready", action="store_true",
        help="readiness: exit 1 while any service or tier is not SERVING (a Redis tier down)")

    def tenant(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--tenant", type=TENANT_FILTER, default="",
                       help=f"admins: {what} (default: the caller's own)")

    def keyed(name: str, hlp: str, by_tenant: bool = True) -> argparse.ArgumentParser:
        p = command(name, hlp)
        p.add_argument("keys", nargs="+", type=key_or_prefix, metavar="KEY",
                       help="keys: 64 hex digits, or a unique prefix (4 or more)")
        p.add_argument("--namespace", type=NAMESPACE, default="default")
        if by_tenant:
            tenant(p, "this tenant's entries")
        p.set_defaults(tenant="")
        return p

    keyed("lookup", "which keys exist, in which tier, how big (exit 1 if one is absent)",
          by_tenant=False)
    keyed("delete", "delete entries from every tier")
    keyed("evict", "drop entries from one tier (default ram)").add_argument(
        "--tier", default="ram", choices=TIERS, help="tier name (default: ram)")
    keyed("pin", "never evict these entries")
    keyed("unpin", "allow eviction again")
    ls = command("ls", "list entries (filter by namespace, model, key prefix, tenant)")
    ls.add_argument("--namespace", type=NAMESPACE_FILTER, default="", help="default: all")
    ls.add_argument("--model", default="",
                    help="model name (as stored, or its last path part) or fingerprint prefix")
    ls.add_argument("--prefix", type=HEX_PREFIX, default="", help="hex key prefix")
    ls.add_argument("--tenant", type=TENANT_FILTER, default="", help="admins: this tenant only")
    ls.add_argument("--limit", type=count, default=0, help="list at most this many (0: all)")
    ins = command("inspect", "one entry: layout, codec, size, tiers, pin, age")
    ins.add_argument("key", type=key_or_prefix, metavar="KEY",
                     help="64 hex digits, or a unique prefix (4 or more)")
    ins.add_argument("--namespace", type=NAMESPACE, default="default")
    tenant(ins, "this tenant's entry")
    ver = command("verify", "check every entry's checksums; remove corrupt ones (exit 1 if any)")
    ver.add_argument("--dry-run", action="store_true", help="report without removing")
    exp = command("export", "write entries to a file (resumes an interrupted one)")
    exp.add_argument("file", metavar="FILE")
    exp.add_argument("--namespace", type=NAMESPACE_FILTER, default="", help="default: all")
    exp.add_argument("--prefix", type=HEX_PREFIX, default="", help="hex key prefix")
    exp.add_argument("--tenant", type=TENANT_FILTER, default="", help="admins: this tenant only")
    imp = command("import", "load an export file (idempotent, verified)")
    imp.add_argument("file", metavar="FILE")
    command("gc", "remove expired entries")
    fleet = command("fleet", "every node of a fleet: health, RAM hit ratio, bytes, load "
                    "(exit 1 unless all are SERVING)")
    fleet.add_argument("--nodes", nargs="+", default=[], metavar="HOST:PORT",
                       help="the nodes, space- or comma-separated (default: $KDN_FLEET)")
    fleet.add_argument("--fleet-file", default="",
                       help="YAML file with `nodes: [HOST:PORT, ...]` (FleetConfig)")
    admin.set_defaults(func=_admin)


def _add_serve(sub: Any) -> None:
    from dataclasses import fields

    from kdn.server.config import ServerConfig, describe

    serve = sub.add_parser("serve", help="run a kdn server", formatter_class=_Formatter,
                           description="Run a kdn server. Settings come from --config FILE "
                           "(YAML), then KDN_<NAME> environment variables, then flags.",
                           epilog=_epilog(SERVE_EXAMPLES))
    serve.add_argument("--config", type=Path, help="YAML file of settings")
    booleans = {f.name for f in fields(ServerConfig) if f.type in ("bool", bool)}
    for name, default, doc in describe():
        flag = {"nargs": "?", "const": "true", "metavar": "true|false"} \
            if name in booleans else {}  # --tracing alone means --tracing true
        serve.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                           help=f"{doc} (default: {default})", **flag)
    serve.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    from kdn.cli.rag import register as register_rag

    ap = _Parser(
        prog="kdn", formatter_class=_Formatter, epilog=_epilog(TOP_EXAMPLES),
        description="kdn: a knowledge delivery network (KV caches for LLMs). Options go "
        "anywhere after their command; `kdn COMMAND --help` lists them.")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_admin(sub)
    register_rag(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        code = int(ns.func(ns))
        sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `kdn admin ls | head`: the reader left; nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit's own flush must not fail again
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
