"""``kdn`` command line: ``kdn serve`` and ``kdn admin ...``.

Exit codes: 0 ok, 1 operation failed (server error, not found), 2 bad usage or bad config.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path
from typing import Any

from kdn.errors import ConfigError, KDNError


def _serve(ns: argparse.Namespace) -> int:
    from kdn.server.app import serve
    from kdn.server.config import describe, load_config

    flags = {name: getattr(ns, name, None) for name, _, _ in describe()}
    try:
        config = load_config(ns.config, flags=flags)
    except ConfigError as exc:
        print(f"kdn serve: bad configuration: {exc}", file=sys.stderr)
        return 2
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    blender = None
    if config.model:  # the model side of the Blend RPC; the model loads on the first Blend
        from kdn.blend.host import ModelBlender

        blender = ModelBlender(name=config.model)
    try:
        asyncio.run(serve(config, blender))
    except OSError as exc:
        print(f"kdn serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _print(obj: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(obj, indent=2, sort_keys=True))
        return
    if isinstance(obj, dict) and "tiers" in obj:
        cols = ["name", "entries", "bytes", "capacity_bytes", "hits", "misses", "evictions",
                "corrupt", "healthy"]
        rows = [[str(t.get(c, "")) for c in cols] for t in obj["tiers"]]
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
        for r in rows:
            print("  ".join(v.ljust(w) for v, w in zip(r, widths)))
        for k, v in sorted(obj.get("counters", {}).items()):
            print(f"{k}: {v}")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            print(f"{k}: {v}")
        return
    print(obj)


def _info_row(e: Any) -> dict[str, Any]:
    return {"namespace": e.namespace, "key": e.key.hex(), "tenant": e.tenant,
            "model": e.model_name or e.model_fingerprint[:12], "codec": (
                f"{e.codec_mode}-{e.codec_level}" if e.codec_level else e.codec_mode),
            "tokens": e.tokens, "bytes": e.size_bytes, "tiers": ",".join(e.tiers),
            "pinned": e.pinned, "age_s": round(e.age_seconds, 1)}


def _cell(value: Any) -> str:
    """One table cell on one line: text with control characters (a model name from a client,
    an entry stored before names were strict) is shown escaped."""
    text = str(value)
    return text if text.isprintable() else ascii(text)[1:-1]


def _table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        print("(no entries)")
        return
    cols = list(rows[0])
    cells = [[_cell(r[c]) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.ljust(w) for v, w in zip(x, widths)))


def _progress(desc: str, enabled: bool) -> Any:
    """A tqdm bar on stderr for long operations (off with --json or when not a terminal)."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit="entry", disable=not enabled or not sys.stderr.isatty())

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    update.close = bar.close  # type: ignore[attr-defined]
    return update


def _admin_client(ns: argparse.Namespace) -> Any:
    import os

    from kdn.client.admin import AdminClient
    from kdn.client.client import TLSOptions

    tls = None
    if ns.tls_ca or ns.tls_cert:
        def read(p: str | None) -> bytes | None:
            return Path(p).read_bytes() if p else None

        tls = TLSOptions(ca=read(ns.tls_ca), cert=read(ns.tls_cert), key=read(ns.tls_key),
                         server_name=ns.tls_server_name or "")
    return AdminClient(ns.address, timeout_s=ns.timeout,
                       api_key=ns.api_key or os.environ.get("KDN_API_KEY") or None, tls=tls)


def _keys(ns: argparse.Namespace) -> list[bytes]:
    return [bytes.fromhex(k) for k in ns.keys]


def _admin(ns: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    def as_dict(msg: Any) -> dict[str, Any]:
        return MessageToDict(msg, preserving_proto_field_name=True,
                             always_print_fields_with_no_presence=True)

    try:
        client = _admin_client(ns)
    except OSError as exc:
        print(f"kdn admin: {exc}", file=sys.stderr)
        return 2
    cmd = ns.admin_cmd
    try:
        if cmd == "stats":
            _print(as_dict(client.stats()), ns.json)
        elif cmd == "health":
            status = client.health()
            _print({"status": status}, ns.json)
            return 0 if status == "SERVING" else 1
        elif cmd == "lookup":
            res = client.lookup(_keys(ns), namespace=ns.namespace)
            _print({k: vars(i) for k, i in zip(ns.keys, res.infos)}, ns.json)
        elif cmd == "delete":
            n = client.delete(_keys(ns), namespace=ns.namespace)
            _print({"deleted": n}, ns.json)
            return 0 if n else 1
        elif cmd == "ls":
            rows = [_info_row(e) for e in client.ls(ns.namespace or "", bytes.fromhex(ns.prefix),
                                                    ns.model or "", ns.tenant or "", ns.limit)]
            print(json.dumps(rows, indent=2)) if ns.json else _table(rows)
        elif cmd == "inspect":
            info = client.inspect(bytes.fromhex(ns.key), ns.namespace)
            _print(as_dict(info) | {"key": ns.key}, True) if ns.json else _print(
                _info_row(info) | {"layout_fingerprint": info.layout_fingerprint,
                                   "layers": info.num_layers, "dtype": info.dtype,
                                   "k_channels": [x.k_channels for x in info.layout.layers],
                                   "v_channels": [x.v_channels for x in info.layout.layers]},
                False)
        elif cmd in ("evict", "pin", "unpin"):
            fn = getattr(client, cmd)
            n = fn(_keys(ns), ns.namespace, ns.tier) if cmd == "evict" else fn(_keys(ns),
                                                                              ns.namespace)
            _print({cmd + ("ed" if cmd == "evict" else "ned"): n}, ns.json)
            return 0 if n else 1
        elif cmd == "verify":
            report: dict[str, Any] = {}
            for p in client.verify(dry_run=ns.dry_run):
                t = report.setdefault(p.tier, {"scanned": 0, "corrupt": 0, "removed": 0,
                                               "corrupt_keys": []})
                t.update(scanned=p.scanned, corrupt=p.corrupt, removed=p.removed)
                t["corrupt_keys"] += list(p.corrupt_keys)
            _print(report, ns.json)
            return 1 if any(t["corrupt"] for t in report.values()) else 0
        elif cmd == "export":
            bar = _progress("export", not ns.json)
            n = client.export_to(Path(ns.file), ns.namespace or "", bytes.fromhex(ns.prefix),
                                 progress=bar)
            bar.close()
            _print({"file": ns.file, "entries": n}, ns.json)
        elif cmd == "import":
            bar = _progress("import", not ns.json)
            resp = client.import_from(Path(ns.file), progress=bar)
            bar.close()
            _print(as_dict(resp), ns.json)
            return 1 if resp.rejected else 0
        elif cmd == "gc":
            _print(as_dict(client.gc()), ns.json)
    except ValueError as exc:
        print(f"kdn admin {cmd}: bad argument: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kdn admin {cmd}: {exc}", file=sys.stderr)
        return 1
    except KDNError as exc:
        print(f"kdn admin {cmd}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    from kdn.cli.args import HEX_KEY, HEX_PREFIX, NAMESPACE, NAMESPACE_FILTER, TENANT_FILTER
    from kdn.server.config import describe

    ap = argparse.ArgumentParser(prog="kdn", description="kdn: a knowledge delivery network")
    sub = ap.add_subparsers(dest="cmd", required=True)

    serve = sub.add_parser("serve", help="run a kdn server",
                           description="Run a kdn server. Settings come from --config FILE "
                           "(YAML), then KDN_<NAME> environment variables, then flags.")
    serve.add_argument("--config", type=Path, help="YAML file of settings")
    for name, default, doc in describe():
        serve.add_argument("--" + name.replace("_", "-"), dest=name, default=None,
                           help=f"{doc} (default: {default})")
    serve.set_defaults(func=_serve)

    admin = sub.add_parser("admin", help="operate a running server")
    admin.add_argument("--address", default="127.0.0.1:50051")
    admin.add_argument("--timeout", type=float, default=30.0)
    admin.add_argument("--json", action="store_true", help="machine-readable output")
    admin.add_argument("--api-key", help="API key (default: $KDN_API_KEY)")
    admin.add_argument("--tls-ca", help="PEM CA to trust (enables TLS)")
    admin.add_argument("--tls-cert", help="client certificate (mutual TLS)")
    admin.add_argument("--tls-key", help="client private key (mutual TLS)")
    admin.add_argument("--tls-server-name", help="expected server certificate name")
    asub = admin.add_subparsers(dest="admin_cmd", required=True)
    asub.add_parser("stats", help="per-tier entries, bytes, hit rates; per tenant; counters")
    asub.add_parser("health", help="the standard gRPC health status")

    def keyed(name: str, hlp: str) -> argparse.ArgumentParser:
        p = asub.add_parser(name, help=hlp)
        p.add_argument("keys", nargs="+", type=HEX_KEY, help="hex keys (64 hex digits each)")
        p.add_argument("--namespace", type=NAMESPACE, default="default")
        return p

    keyed("lookup", "which keys exist, in which tier, how big")
    keyed("delete", "delete entries from every tier")
    keyed("evict", "drop entries from one tier (default ram)").add_argument("--tier", default="")
    keyed("pin", "never evict these entries")
    keyed("unpin", "allow eviction again")
    ls = asub.add_parser("ls", help="list entries (filter by namespace, model, key prefix)")
    ls.add_argument("--namespace", type=NAMESPACE_FILTER, default="")
    ls.add_argument("--model", default="", help="model fingerprint prefix")
    ls.add_argument("--prefix", type=HEX_PREFIX, default="", help="hex key prefix")
    ls.add_argument("--tenant", type=TENANT_FILTER, default="", help="admins: this tenant only")
    ls.add_argument("--limit", type=int, default=0, help="page size")
    ins = asub.add_parser("inspect", help="one entry: layout, codec, size, tiers, pin")
    ins.add_argument("key", type=HEX_KEY)
    ins.add_argument("--namespace", type=NAMESPACE, default="default")
    ver = asub.add_parser("verify", help="check every entry's checksums; remove corrupt ones")
    ver.add_argument("--dry-run", action="store_true", help="report without removing")
    exp = asub.add_parser("export", help="write entries to a file (resumes an interrupted one)")
    exp.add_argument("file")
    exp.add_argument("--namespace", type=NAMESPACE_FILTER, default="")
    exp.add_argument("--prefix", type=HEX_PREFIX, default="", help="hex key prefix")
    imp = asub.add_parser("import", help="load an export file (idempotent, verified)")
    imp.add_argument("file")
    asub.add_parser("gc", help="remove expired entries")
    admin.set_defaults(func=_admin)
    from kdn.rag.cli import register as register_rag
    register_rag(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
