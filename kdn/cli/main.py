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
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

from kdn import __version__
from kdn.cli.admin import run as run_admin
from kdn.cli.args import (
    BadVariable,
    add_output_options,
    address,
    checked,
    count,
    env_default,
    key_or_prefix,
    model_problem,
    positive,
)
from kdn.cli.output import EXIT_FAILED, EXIT_OK, EXIT_USAGE, error

EXIT_CODES = """\
exit codes:
  0  ok
  1  the command ran and found a failure: the server is unreachable or answered an error,
     an entry is absent, verify found corrupt entries, health: the server is not SERVING
     (with --ready: a service or tier is not), an export or import file is damaged
     or could not be written (a full disk, a pipe whose reader left)
  2  usage: an unknown command or option, a malformed value (an address without a port, an
     ambiguous key prefix), a missing file, state folder or model, a bad configuration or a
     misspelt KDN_* variable"""
DEFAULT_ADDRESS = "127.0.0.1:50051"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Epilogs keep their lines (examples, exit codes); option help is wrapped."""


class _Parser(argparse.ArgumentParser):
    """argparse's parser with a usage error on one line (``kdn admin ls: argument --limit:
    ...; see kdn admin ls --help``), exit code 2, instead of the usage block."""

    given: list[str] = []
    """The words this parser was given (``parse_known_args``)."""

    def error(self, message: str) -> NoReturn:
        if message.startswith("the following arguments are required") and \
                (unknown := self._unknown_options()):  # (an unknown option first: its name)
            message = f"unrecognized arguments: {' '.join(unknown)}"
        error(self.prog, message, f"see {self.prog} --help")
        sys.exit(EXIT_USAGE)

    def _unknown_options(self) -> list[str]:
        """The options among ``given`` this parser does not know (nor any of its options'
        abbreviations, which argparse takes): ``kdn --jsn`` is refused naming ``--jsn``, not
        for the COMMAND it lacks."""
        words = self.given[:self.given.index("--")] if "--" in self.given else self.given
        known = list(self._option_string_actions)
        return [w for w in words if w.startswith("-") and len(w) > 1 and not any(
            o.startswith(w.partition("=")[0]) for o in known)]

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        """Arguments a command does not know are refused by that command's parser, which
        names it (``kdn admin stats: unrecognized arguments: --bogus``), not by ``kdn``'s."""
        self.given = list(sys.argv[1:] if args is None else args)
        try:
            ns, extra = super().parse_known_args(self.given, namespace)
        except BadVariable as exc:  # a default from the environment: no option to name
            self.error(str(exc))
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
    g.add_argument("--address", type=checked(address),
                   default=default(env_default("KDN_ADDRESS", DEFAULT_ADDRESS)),
                   help=f"server host:port (default: $KDN_ADDRESS or {DEFAULT_ADDRESS})")
    g.add_argument("--timeout", type=positive, default=default(30.0),
                   help="seconds per call (default: 30)")
    g.add_argument("--api-key", default=default(None), help="API key (default: $KDN_API_KEY)")
    g.add_argument("--tls-ca", default=default(None),
                   help="PEM CA to trust (enables TLS; default for a loopback --address: "
                        "$KDN_TLS_CERT, the server's own certificate, where set)")
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
    from kdn.errors import ConfigError, DiskFull, InUse
    from kdn.server.config import describe, load_config

    flags = {name: getattr(ns, name, None) for name, _, _ in describe()}
    notes: list[str] = []  # warnings, logged once logging has the configured format
    try:
        config = load_config(ns.config, flags=flags, notes=notes)
    except ConfigError as exc:
        error("kdn serve", f"bad configuration: {exc}", "see kdn serve --help")
        return EXIT_USAGE
    if config.model and (why := model_problem(config.model)):
        error("kdn serve", why)
        return EXIT_USAGE

    import asyncio
    import logging

    from kdn.server.app import serve
    from kdn.server.logs import configure

    configure(config.log_level, config.log_format)
    for line in notes:
        logging.getLogger("kdn.server.config").warning("%s", line)
    blender = None
    if config.model:  # the model side of the Blend RPC; the model loads on the first Blend
        from kdn.blend.host import ModelBlender

        blender = ModelBlender(name=config.model)
    try:
        asyncio.run(serve(config, blender))
    except ConfigError as exc:  # found at start-up: TLS files that do not make a pair, ...
        error("kdn serve", f"bad configuration: {exc}")
        return EXIT_USAGE
    except (InUse, DiskFull) as exc:  # another server's data folder, or its disk full
        error("kdn serve", str(exc))
        return EXIT_FAILED
    except OSError as exc:  # a port taken, a data folder that can not be written
        error("kdn serve", f"{exc.filename}: {exc.strerror}" if exc.filename
              else exc.strerror or str(exc))
        return EXIT_FAILED
    return EXIT_OK


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
    admin.set_defaults(func=run_admin)


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
                           help=f"{doc} (default: {default})".replace("%", "%%"),
                           **flag)  # (argparse formats help with %: a "75%" is written as-is)
    serve.set_defaults(func=_serve)


def build_parser() -> argparse.ArgumentParser:
    from kdn.cli.rag import register as register_rag

    ap = _Parser(
        prog="kdn", formatter_class=_Formatter, epilog=_epilog(TOP_EXAMPLES),
        description="kdn: a knowledge delivery network (KV caches for LLMs). Options go "
        "anywhere after their command; `kdn COMMAND --help` lists them.")
    ap.add_argument("--version", action="version", version=f"kdn {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_admin(sub)
    register_rag(sub)
    return ap


_OPTION = re.compile(r"--?[a-z][a-z-]*")


def _keys_joined(argv: list[str]) -> list[str]:
    """``--api-key KEY`` as ``--api-key=KEY``: argparse takes a value starting with '-' for an
    option (a key of ``secrets.token_urlsafe``, one in 64, was 'expected one argument'). A
    next word that looks like an option (``--api-key --address ...``, the key left out) stays
    apart, for argparse to say the key is missing."""
    out: list[str] = []
    words = iter(argv)
    for word in words:
        if word == "--":
            out += [word, *words]
        elif word == "--api-key":
            value = next(words, None)
            out += [word] if value is None else [word, value] if _OPTION.fullmatch(value) \
                else [f"{word}={value}"]
        else:
            out.append(word)
    return out


def main(argv: list[str] | None = None) -> int:
    # before grpc is imported: its native log lines (a failed TLS handshake's, one per try)
    # are not the one line a command prints; GRPC_VERBOSITY=INFO (or DEBUG) shows them. A
    # server's: none (a caller's malformed header was a plain-text ERROR line on stderr each
    # call, amid --log-format json's lines); kdn logs what it serves itself
    command = (sys.argv[1:] if argv is None else argv)[:1]
    os.environ.setdefault("GRPC_VERBOSITY", "NONE" if command == ["serve"] else "ERROR")
    ns = build_parser().parse_args(_keys_joined(sys.argv[1:] if argv is None else argv))
    try:
        code = int(ns.func(ns))
        if sys.stdout is not None:  # (None: started with stdout closed, `>&-`)
            sys.stdout.flush()
        return code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as exc:
        if not _stdout_gone():  # a connection of the command's own: its failure
            error("kdn", exc)
            return EXIT_FAILED
        # `kdn admin ls | head`: the reader left, which is no failure of the command (`health`
        # exits 1 only for a server that is not SERVING); nothing to report
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the exit's own flush must not fail again
        return EXIT_OK


def _stdout_gone() -> bool:
    """Whether standard output is a pipe or socket whose reader has left (a write to it
    fails with EPIPE): poll reports an error or a hang-up on it."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no poll here; stdout closed or not a file
        return False


if __name__ == "__main__":
    sys.exit(main())
