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
    try:
        asyncio.run(serve(config))
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


def _admin(ns: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict

    from kdn.client import Client

    client = Client(ns.address, timeout_s=ns.timeout)
    try:
        if ns.admin_cmd == "stats":
            d = MessageToDict(client.stats(), preserving_proto_field_name=True,
                              always_print_fields_with_no_presence=True)
            _print(d, ns.json)
        elif ns.admin_cmd == "health":
            status = client.health()
            _print({"status": status}, ns.json)
            return 0 if status == "SERVING" else 1
        elif ns.admin_cmd == "lookup":
            keys = [bytes.fromhex(k) for k in ns.keys]
            res = client.lookup(keys, namespace=ns.namespace)
            _print({k: vars(i) for k, i in zip(ns.keys, res.infos)}, ns.json)
        elif ns.admin_cmd == "delete":
            n = client.delete([bytes.fromhex(k) for k in ns.keys], namespace=ns.namespace)
            _print({"deleted": n}, ns.json)
            return 0 if n else 1
    except ValueError as exc:
        print(f"kdn admin: bad key: {exc}", file=sys.stderr)
        return 2
    except KDNError as exc:
        print(f"kdn admin {ns.admin_cmd}: {exc}", file=sys.stderr)
        return 1
    finally:
        client.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
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
    asub = admin.add_subparsers(dest="admin_cmd", required=True)
    asub.add_parser("stats", help="per-tier entries, bytes, hit rates; server counters")
    asub.add_parser("health", help="the standard gRPC health status")
    for name, hlp in (("lookup", "which keys exist and where"), ("delete", "delete keys")):
        p = asub.add_parser(name, help=hlp)
        p.add_argument("keys", nargs="+", help="hex keys")
        p.add_argument("--namespace", default="default")
    admin.set_defaults(func=_admin)
    return ap


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    return int(ns.func(ns))


if __name__ == "__main__":
    sys.exit(main())
