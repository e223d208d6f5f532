"""``kdn admin ...``: the commands an operator runs against a server (stats, health, lookup,
delete, evict, pin, unpin, ls, inspect, verify, export, import, gc, fleet), each a function of
(client, parsed options) that prints and returns its exit code (``kdn.cli.main.EXIT_CODES``);
``run`` makes the client and turns errors into one line. The parser is ``kdn.cli.main``'s."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

from kdn.cli.args import check_environment
from kdn.cli.output import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    PATH_MISTAKES,
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


def tls_options(ns: argparse.Namespace) -> Any:
    """The ``TLSOptions`` the --tls-* options name (their files read), None without them."""
    from kdn.client.client import TLSOptions

    if not (ns.tls_ca or ns.tls_cert or ns.tls_key):
        return None
    paired = bool(ns.tls_cert) == bool(ns.tls_key)  # (else TLSOptions says so first)

    def read(p: str | None, name: str) -> bytes | None:
        if not p:
            return None
        return read_pem(p, name) if paired else Path(p).read_bytes()

    return TLSOptions(ca=read(ns.tls_ca, "ca"), cert=read(ns.tls_cert, "cert"),
                      key=read(ns.tls_key, "key"), server_name=ns.tls_server_name or "")


def read_pem(path: str, name: str) -> bytes:
    """The PEM file option --tls-NAME names, read: a UsageError naming the file when it is
    not PEM or not the kind ``name`` says (``kdn.client.rpc.pem_problem``)."""
    from kdn.client.rpc import pem_problem

    data = Path(path).read_bytes()
    if b"-----BEGIN " not in data:
        raise UsageError(f"{path}: not a PEM file (no '-----BEGIN' line)")
    if problem := pem_problem(name, data):
        raise UsageError(f"{path} (--tls-{name}): {problem}")
    return data


def own_certificate(address: str, server_name: str | None) -> Any:
    """Without --tls-* options, for a command run beside the server (the deploy files' health
    probes, in its container): TLS trusting ``$KDN_TLS_CERT`` (the server's certificate:
    self-signed, or a chain that holds its CA) and expecting a name it carries, when
    ``address`` is on this machine and the variable is set; else None (plaintext). A server
    under mutual TLS (``tls_client_ca``) wants a client certificate too: pass --tls-ca,
    --tls-cert and --tls-key (so does one whose CA the file lacks: --tls-ca)."""
    from kdn.client.client import TLSOptions
    from kdn.transport.addresses import is_loopback

    path = os.environ.get("KDN_TLS_CERT", "").strip()
    host = address.rpartition(":")[0].strip("[]")
    if not path or not is_loopback(host):
        return None
    pem = Path(os.path.expanduser(path)).read_bytes()
    if not server_name:
        import ssl

        try:  # the certificate's names: (("DNS", "kdn.example"), ("IP Address", ...), ...)
            cert = ssl._ssl._test_decode_cert(  # type: ignore[attr-defined]
                os.path.expanduser(path))
        except (AttributeError, ssl.SSLError, OSError):
            cert = {}
        server_name = _name_to_expect(host, list(cert.get("subjectAltName", ())), [
            v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"])
    return TLSOptions(ca=pem, server_name=server_name)


def _name_to_expect(host: str, sans: list[tuple[str, str]], common: list[str]) -> str:
    """The name to expect of a certificate with ``sans`` (its subjectAltName: ("DNS", name)
    and ("IP Address", ip) pairs; else its ``common`` names) on ``host``: "" where ``host`` is
    among them (an IP compared as an address: Python writes ::1 as 0:0:0:0:0:0:0:1), else its
    first DNS name, else "" (an IP's rendering given as the name is matched by no IP SAN)."""
    import ipaddress

    def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
        try:
            return ipaddress.ip_address(text.strip())
        except ValueError:
            return None

    names = [v for k, v in sans if k in ("DNS", "IP Address")] if sans else common
    dns = [n for n in names if ip(n) is None]
    ips = {ip(n) for n in names} - {None}
    if (ip(host) is not None and ip(host) in ips) or host.lower() in (n.lower() for n in dns):
        return ""
    return dns[0] if dns else ""


def admin_client(ns: argparse.Namespace) -> Any:
    from kdn.client.admin import AdminClient

    return AdminClient(ns.address, timeout_s=ns.timeout,
                       api_key=ns.api_key or os.environ.get("KDN_API_KEY") or None,
                       tls=tls_options(ns) or own_certificate(ns.address, ns.tls_server_name),
                       shm_bytes=0, insecure=ns.insecure or None)


class UsageError(Exception):
    """A mistake found after parsing (an ambiguous key prefix): one line, exit 2."""


def resolve(client: Any, text: str, namespace: str, tenant: str = "") -> bytes:
    """The key ``text`` names in ``namespace`` (of ``tenant``: admins): itself when whole (64
    hex digits), else the one stored key it is a prefix of (as git's short hashes; an admin's
    listing without a tenant shows the same key once per tenant). No match: NotFound (exit 1);
    several: a UsageError naming them (exit 2). A key only other tenants hold (an admin's
    listing shows every tenant's; the command acts in its own key space without --tenant):
    NotFound naming the tenants and the --tenant to add."""
    from kdn.names import KEY_BYTES, UNSCOPED

    if len(text) == 2 * KEY_BYTES:
        return bytes.fromhex(text)
    found: list[str] = []
    owners: set[str] = set()
    for e in client.ls(namespace, bytes.fromhex(text[: len(text) // 2 * 2]), tenant=tenant,
                       limit=16):
        if e.key.hex().startswith(text) and e.key.hex() not in found:
            found.append(e.key.hex())
        if e.key.hex().startswith(text):
            owners.add(e.tenant)
        if len(found) > 3:
            break
    if not found:
        raise NotFound(f"no entry whose key starts with {text} in namespace {namespace!r}")
    if len(found) > 1:
        raise UsageError(f"key prefix {text} is ambiguous in namespace {namespace!r}: "
                         f"{', '.join(found[:3])}{', ...' if len(found) > 3 else ''}; "
                         "give more digits")
    key = bytes.fromhex(found[0])
    if not tenant and owners and not client.lookup([key], namespace=namespace).infos[
            0].present:  # listed in other tenants' key spaces only ("": the unscoped one)
        named = sorted(t or UNSCOPED for t in owners)
        raise NotFound(f"no entry {found[0]} in namespace {namespace!r} of your tenant: it is "
                       f"tenant {', '.join(named)}'s; add --tenant {named[0]}")
    return key


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
    from kdn.client.admin import NO_KEY

    report = client.health_report()
    keyless = report["tiers_hidden"] == NO_KEY  # a probe: a DEGRADED tier goes unseen
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
        if report["tiers_hidden"]:
            given = "--api-key" if ns.api_key else "$KDN_API_KEY"
            print(f"tiers hidden: {report['tiers_hidden']}" + (
                " (--api-key shows them)" if keyless else f"; check the key {given} gives"),
                file=sys.stderr)
    if ns.ready:  # readiness: every service and tier SERVING; a refused key checked none
        ok = report["status"] == "SERVING" and (report["tiers"] is not None or keyless)
        return EXIT_OK if ok else EXIT_FAILED
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
    except BrokenPipeError:  # a pipe's reader left: not main's quiet `| head` exit
        error("kdn admin export", f"{ns.file}: its reader left; what it read is cut off")
        return EXIT_FAILED
    finally:
        bar.close()
    with contextlib.redirect_stdout(sys.stderr) if _is_stdout(ns.file) else \
            contextlib.nullcontext():  # `export /dev/stdout > f`: the summary is not the file's
        if ns.output == "json":
            dump_json({"file": ns.file, "entries": n})
        else:
            fields([("file", ns.file), ("entries", n)])
    return EXIT_OK


def _is_stdout(file: str) -> bool:
    """Whether ``file`` is what standard output writes to (``/dev/stdout``, ``/dev/fd/1``, the
    file ``>`` sent it to, the pipe it goes into)."""
    try:
        return os.path.samestat(os.stat(file), os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError, AttributeError):  # no such file; stdout closed or not a file
        return False


def _import(client: Any, ns: argparse.Namespace) -> int:
    if Path(ns.file).is_dir():
        raise IsADirectoryError(21, "is a directory, not an export file", ns.file)
    if not Path(ns.file).exists():
        raise FileNotFoundError(2, "no such file", ns.file)
    if not Path(ns.file).is_file():  # a pipe, /dev/stdin: its records would be gone
        raise UsageError(f"{ns.file}: not a regular file (import reads it twice: checks "
                         "first, then sends); save it to a file first")
    bar = _progress("import", ns)
    try:
        resp = client.import_from(Path(ns.file), progress=bar)
    finally:
        bar.close()
    d = message_dict(resp)
    if ns.output == "json":
        dump_json(d)
    else:
        fields((k, v) for k, v in d.items() if k != "reasons")
    for reason in resp.reasons:  # (json: its "reasons" too)
        print(f"kdn admin import: rejected {reason}", file=sys.stderr)
    if resp.rejected > len(resp.reasons):
        print(f"kdn admin import: {resp.rejected - len(resp.reasons)} more rejected; the "
              "server's log says why", file=sys.stderr)
    return EXIT_FAILED if resp.rejected else EXIT_OK


def _gc(client: Any, ns: argparse.Namespace) -> int:
    d = message_dict(client.gc())
    dump_json(d) if ns.output == "json" else fields(d.items())
    return EXIT_OK


def _fleet_nodes(ns: argparse.Namespace) -> list[str]:
    """The fleet's addresses: --nodes, else --fleet-file's ``nodes:``, else $KDN_FLEET (both
    options: a ConfigError, as one would be ignored)."""
    from kdn.errors import ConfigError

    if ns.nodes and ns.fleet_file:
        raise ConfigError("--nodes and --fleet-file both name the fleet; pass one of them")
    if ns.nodes:
        return [a.strip() for arg in ns.nodes for a in arg.split(",") if a.strip()]
    if ns.fleet_file:
        from kdn.client.fleet import FleetConfig

        return list(FleetConfig.from_file(Path(ns.fleet_file)).nodes)
    return [a.strip() for a in os.environ.get("KDN_FLEET", "").split(",") if a.strip()]


def _fleet(ns: argparse.Namespace, tls: Any) -> int:
    """Every node of a fleet: health, RAM hit ratio, bytes, load (``kdn.client.fleet``)."""
    from kdn.client.fleet import FleetConfig, fleet_view
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
    try:  # the fleet's own rules: host:port, a port in 1..65535, no node listed twice
        nodes = list(FleetConfig(nodes=tuple(nodes)).nodes)
    except ConfigError as exc:
        error(prog, exc)
        return EXIT_USAGE
    rows = fleet_view(nodes, timeout_s=ns.timeout,
                      api_key=ns.api_key or os.environ.get("KDN_API_KEY") or None,
                      tls=tls, insecure=ns.insecure or None)
    if ns.output == "json":
        dump_json(rows)
    else:
        table([{**r, "ram_size": "" if r["ram_bytes"] is None else human_size(r["ram_bytes"])}
               for r in rows],
              ["node", "status", "ram_entries", "ram_size", "ram_hit_ratio", "redis_hits",
               "in_flight", "error"])
    return EXIT_OK if all(r["status"] == "SERVING" for r in rows) else EXIT_FAILED


ADMIN = {"stats": _stats, "health": _health, "lookup": _lookup, "delete": _delete,
         "evict": _evict, "pin": _pin, "unpin": _unpin, "ls": _ls, "inspect": _inspect,
         "verify": _verify, "export": _export, "import": _import, "gc": _gc}


def _key_hint(exc: KDNError) -> str:
    """The hint for a client refused before any call: --insecure only where the refusal is
    an API key that would travel in plaintext."""
    return "or pass --insecure" if "plaintext" in str(exc) else ""


def _hint(exc: KDNError, ns: argparse.Namespace) -> str:
    if isinstance(exc, Unavailable):
        said = str(exc).lower()
        if "handshake" in said or "certificate" in said:
            return ("the TLS handshake failed: check --tls-ca (the CA that signed the server's "
                    "certificate) and --tls-server-name")
        if "socket closed" in said and not ns.tls_ca:
            return ("the server closed the connection: does it take TLS only? (pass --tls-ca; "
                    "else set --address or $KDN_ADDRESS)")
        return f"is a kdn server listening on {ns.address}? (set --address or $KDN_ADDRESS)"
    if isinstance(exc, DeadlineExceeded):
        return "the server did not answer in time; raise --timeout"
    if isinstance(exc, Unauthenticated):
        return "pass --api-key or set $KDN_API_KEY"
    if isinstance(exc, PermissionDenied):
        return "this command needs an API key of the admin role"
    return ""


def run(ns: argparse.Namespace) -> int:
    prog = f"kdn admin {ns.admin_cmd}"
    if not check_environment(prog):
        return EXIT_USAGE
    try:
        if ns.admin_cmd == "fleet":  # many nodes, each with its own client
            return _fleet(ns, tls_options(ns))
        client = admin_client(ns)
    except OSError as exc:  # a TLS file that can not be read
        error(prog, f"{exc.filename}: {exc.strerror}", "check the --tls-* paths")
        return EXIT_USAGE
    except UsageError as exc:  # one that is not PEM
        error(prog, exc, "check the --tls-* paths")
        return EXIT_USAGE
    except KDNError as exc:  # an API key that would travel in plaintext, or is no header
        error(prog, exc, _key_hint(exc))
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
        name = exc.filename or getattr(ns, "file", None)
        error(prog, f"{name}: {exc.strerror or exc}" if name else str(exc))
        # a path that is wrong is a usage mistake; a disk that filled, an I/O error: a failure
        return EXIT_USAGE if exc.errno in PATH_MISTAKES else EXIT_FAILED
    finally:
        client.close()
