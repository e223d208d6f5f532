"""The ``kdn`` CLI as an operator meets it: every command in the README and in each ``--help``
example parses and runs as written, options stand anywhere, JSON is typed, exit codes follow
the documented rule, and ``kdn admin health`` tells the truth about each tier."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn import keys
from kdn.cli.main import build_parser
from kdn.cli.main import main as cli
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from tests.helpers import make_certs, random_kv, uniform_layout
from tests.redis_servers import RedisServer

ROOT = Path(__file__).resolve().parent.parent
LAY = uniform_layout(layers=2, heads=2, dim=8)


def _epilogs(parser: argparse.ArgumentParser) -> Iterator[str]:
    yield parser.epilog or ""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _epilogs(sub)


def _commands(text: str, *, code_blocks: bool) -> list[str]:
    """``kdn ...`` command lines (``$ `` prompts, trailing ``&`` and ``# comments`` dropped);
    synopsis lines (``[--opt]``, ``a | b``, ``…``) are not commands."""
    if code_blocks:
        text = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S))
    out = []
    for line in text.splitlines():
        line = line.strip().removeprefix("$ ")
        if not line.startswith("kdn "):
            continue
        line = re.sub(r"\s+#.*$", "", line).rstrip("& ").strip()
        if any(c in line for c in "[|…"):
            continue
        out.append(line)
    return out


def readme_commands() -> list[str]:
    return _commands((ROOT / "README.md").read_text(encoding="utf-8"), code_blocks=True)


def help_commands() -> list[str]:
    return sorted({c for e in _epilogs(build_parser()) for c in _commands(e, code_blocks=False)})


def test_there_are_examples_to_check() -> None:
    assert len(help_commands()) >= 12 and len(readme_commands()) >= 6
    assert "kdn rag ingest docs/ --state .kdn-rag" in readme_commands()


@pytest.mark.parametrize("line", sorted({*readme_commands(), *help_commands()}))
def test_every_documented_command_parses(line: str) -> None:
    argv = [a.replace("KEY", "ab" * 32) for a in shlex.split(line)[1:]]  # the placeholder
    ns = build_parser().parse_args(argv)
    assert callable(ns.func)
    if ns.cmd == "serve":  # its flags also make a valid configuration
        from kdn.server.config import describe, load_config

        load_config(None, flags={n: getattr(ns, n, None) for n, _, _ in describe()})


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerThread, str]]:
    tmp = tmp_path_factory.mktemp("cli")
    with ServerThread(ServerConfig(port=0, data_dir=tmp / "data")) as server:
        key = keys.chunk_key([1, 2, 3], LAY)
        with Client(server.address) as c:
            c.store(key, random_kv(LAY, 8, seed=1), namespace="kb")
        yield server, key.hex()


def test_every_documented_admin_command_runs(live: tuple[ServerThread, str], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    server, key = live
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KDN_ADDRESS", server.address)
    lines = [c for c in sorted({*readme_commands(), *help_commands()})
             if c.startswith("kdn admin ")]
    assert len(lines) >= 8
    for i, line in enumerate(lines):
        with Client(server.address) as c:  # back, whatever delete or evict did before
            c.store(bytes.fromhex(key), random_kv(LAY, 8, seed=1), namespace="kb")
        # KEY: the whole key, or (every other line) the prefix `ls` prints
        argv = [a.replace("KEY", key if i % 2 else key[:12]) for a in shlex.split(line)[1:]]
        named = [a for a in argv if re.fullmatch(r"[\d.]+:\d+", a)]
        if len(set(named)) > 1:  # a fleet of several nodes: as many live servers
            with contextlib.ExitStack() as more:
                others = [more.enter_context(ServerThread(ServerConfig(
                    port=0, data_dir=tmp_path / f"node{j}"))).address
                    for j in range(len(set(named)) - 1)]
                where = dict(zip(dict.fromkeys(named), [server.address, *others]))
                code = cli([where.get(a, a) for a in argv])
            out = capsys.readouterr()
            assert code == 0, (line, out.err)
            continue
        argv = [server.address if re.fullmatch(r"[\d.]+:\d+", a) else a for a in argv]
        if argv[1] == "import":  # the export example wrote the file first
            (tmp_path / argv[2]).exists() or cli(["admin", "export", argv[2]])
        code = cli(argv)
        out = capsys.readouterr()
        assert code == 0, (line, out.err)
        assert "Traceback" not in out.err


def test_options_anywhere_and_typed_json(live: tuple[ServerThread, str],
                                         capsys: pytest.CaptureFixture[str]) -> None:
    server, key = live
    a = ["--address", server.address]
    outs = []
    for argv in (["admin", *a, "--json", "stats"], ["admin", "stats", "--json", *a],
                 ["admin", "stats", *a, "-o", "json"]):
        assert cli(argv) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert all(set(o) == set(outs[0]) for o in outs)
    tiers = outs[0]["tiers"]
    assert {t["name"] for t in tiers} == {"ram", "disk"}
    assert all(isinstance(t["bytes"], int) and isinstance(t["healthy"], bool) for t in tiers)
    assert all(isinstance(v, int) for v in outs[0]["counters"].values())
    assert cli(["admin", "lookup", key, "--namespace", "kb", *a, "-o", "json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row == {"key": key, "present": True, "tier": "ram", "size_bytes": row["size_bytes"]}
    assert isinstance(row["size_bytes"], int) and row["size_bytes"] > 0
    absent = "00" * 32
    assert cli(["admin", "lookup", absent, *a, "--json"]) == 1  # a failure found: exit 1
    assert json.loads(capsys.readouterr().out)[0]["present"] is False
    assert cli(["admin", "ls", *a]) == 0  # the table: a real age, the stored model name
    table = capsys.readouterr().out
    assert "kb" in table and re.search(r"\b\d+[smhd]\b", table), table


@pytest.mark.parametrize("argv, code, words", [
    (["admin", "stats", "--address", "127.0.0.1:1", "--timeout", "2"], 1,
     "is a kdn server listening on 127.0.0.1:1"),
    (["admin", "inspect", "zz"], 2, "key 'zz' is malformed"),
    (["admin", "stats", "-o", "yaml"], 2, "invalid choice: 'yaml'"),
    (["admin", "import", "/nonexistent/x.kdnx", "--address", "127.0.0.1:1"], 2,
     "/nonexistent/x.kdnx"),
    (["rag", "ask", "hi", "--state", "{tmp}"], 2, "no corpus has been ingested"),
    (["rag", "ingest", "/nonexistent/docs", "--state", "{tmp}"], 2, "does not exist"),
    (["rag", "ingest", "README.md", "--state", "{tmp}", "--mode", "kdn", "--level", "l2"], 2,
     "has no level 'l2'"),
    (["rag", "ingest", "README.md", "--state", "{tmp}", "--model", "org/some-model"], 2,
     "is neither 'smollm2-135m'"),
    (["rag", "ingest", "README.md", "--state", "{tmp}", "--device", "gpu0"], 2,
     "--device 'gpu0' is not a device"),
    (["admin", "stats", "--address", "127.0.0.1:1", "--tls-cert", "README.md"], 2,
     "a client certificate and its private key go together (given: the certificate only)"),
    (["admin", "stats", "--address", "127.0.0.1:1", "--tls-key", "README.md"], 2,
     "(given: the key only)"),
    (["serve", "--port", "99999"], 2, "port"),
    (["serve", "--model", "org/some-model"], 2, "is neither 'smollm2-135m'"),
    (["serve", "--model", "{tmp}"], 2, "is not a transformers model folder"),
])
def test_user_mistakes_are_one_line_and_exit_codes(argv: list[str], code: int, words: str,
                                                   tmp_path: Path) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", "kdn", *argv], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == code, proc.stderr
    assert words in proc.stderr and "Traceback" not in proc.stderr
    if code == 1 or argv[0] == "rag":  # not argparse's usage block: one line
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_help_loads_neither_torch_nor_grpc() -> None:
    probe = ("import sys\nfrom kdn.cli.main import main\ntry:\n    main(['--help'])\n"
             "except SystemExit:\n    pass\n"
             "for p in ('kdn', 'admin', 'serve', 'rag'):\n"
             "    try:\n        main([p, '--help'] if p != 'kdn' else ['--help'])\n"
             "    except SystemExit:\n        pass\n"
             "print(sorted(m for m in ('torch', 'grpc', 'transformers', 'numpy') "
             "if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


def test_health_liveness_and_readiness_while_a_tier_is_down(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kdn admin health`` is liveness: exit 0 while the server serves (from RAM and disk with
    Redis down); ``--ready`` is readiness: exit 1 while any service or tier is not SERVING."""
    with RedisServer(tmp_path / "redis") as redis_server:
        cfg = ServerConfig(port=0, data_dir=tmp_path / "data", redis_url=redis_server.url,
                           redis_timeout_s=0.3, redis_retries=0)
        with ServerThread(cfg) as server:
            a = ["--address", server.address]
            for extra in ([], ["--ready"]):
                assert cli(["admin", "health", *a, *extra, "-o", "json"]) == 0
                report = json.loads(capsys.readouterr().out)
            assert report["status"] == "SERVING"
            assert report["tiers"] == {"ram": "SERVING", "redis": "SERVING", "disk": "SERVING"}
            assert report["services"] == {"kdn.v1.KDN": "SERVING"}
            assert report["parts_down"] == {}  # a standalone Redis has no parts
            redis_server.kill()
            from tests.helpers import eventually

            def not_ready() -> bool:
                code = cli(["admin", "health", "--ready", *a, "-o", "json"])
                report.update(json.loads(capsys.readouterr().out))
                return code == 1
            assert eventually(not_ready, timeout=15)
            assert report["tiers"]["redis"] == "NOT_SERVING"
            assert report["tiers"]["ram"] == "SERVING" and report["server"] == "SERVING"
            assert cli(["admin", "health", *a]) == 0  # alive: the server answers from RAM+disk
            table = capsys.readouterr().out
            assert re.search(r"redis\s+tier\s+NOT_SERVING", table), table
        # the server gone: liveness fails too
        assert cli(["admin", "health", *a, "--timeout", "2"]) == 1
        assert "is a kdn server listening" in capsys.readouterr().err


def test_serve_boolean_flags_alone_mean_true() -> None:
    """``--tracing`` alone is ``--tracing true``; ``--reuse-port false`` stays false; a value
    that is no boolean is refused by the config loader, naming the setting."""
    from kdn.server.config import load_config

    ns = build_parser().parse_args(["serve", "--tracing", "--reuse-port", "false", "--port", "0"])
    assert (ns.tracing, ns.reuse_port, ns.insecure) == ("true", "false", None)
    cfg = load_config(None, flags={"tracing": ns.tracing, "reuse_port": ns.reuse_port})
    assert cfg.tracing is True and cfg.reuse_port is False
    from kdn.errors import ConfigError

    with pytest.raises(ConfigError, match="tracing"):
        load_config(None, flags={"tracing": "maybe"})


def test_serve_help_shows_each_settings_doc_as_written(capsys: pytest.CaptureFixture[str]
                                                       ) -> None:
    """argparse formats help text with ``%``: a setting's doc saying "75% of the room" made
    ``kdn serve --help`` fail (TypeError: %o format). Every doc shows as written."""
    from kdn.server.config import describe

    with pytest.raises(SystemExit):
        cli(["serve", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    docs = [doc for _, _, doc in describe()]
    assert any("%" in doc for doc in docs)  # the case this is about is among them
    for doc in docs:
        assert re.sub(r"\s+", " ", doc[:60]).strip() in shown, doc


def test_admin_refuses_what_it_can_not_send_in_one_line_before_any_call(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A --tls-ca that is not PEM ("None: no start line"), a port of non-ASCII digits (taken,
    then "unreachable", exit 1) and an API key no gRPC header can carry (gRPC's own log lines
    and "INTERNAL: Invalid metadata") are usage errors naming what is wrong (exit 2)."""
    from kdn.client.client import TLSOptions
    from kdn.errors import InvalidArgument

    not_pem = tmp_path / "ca.crt"
    not_pem.write_text("hello\n")
    (tmp_path / "pki").mkdir()
    certs = make_certs(tmp_path / "pki")  # a key for a certificate: gRPC's "None: no start line"
    key = certs["server.key"]
    for args, says in (
            (["--tls-ca", str(not_pem)], f"{not_pem}: not a PEM file (no '-----BEGIN' line)"),
            (["--tls-ca", str(key)], f"{key} (--tls-ca): holds no certificate"),
            (["--tls-ca", str(certs["ca.crt"]), "--tls-cert", str(certs["server.crt"]),
              "--tls-key", str(certs["server.crt"])], "(--tls-key): holds no private key"),
            (["--address", "127.0.0.1:\u0665\u0660"], "port must be in 1..65535"),
            (["--api-key", "\u043a\u043b\u044e\u0447"], "api_key must be printable ASCII")):
        address = [] if "--address" in args else ["--address", "127.0.0.1:1"]
        try:
            code = cli(["admin", "stats", *address, *args])
        except SystemExit as exc:  # argparse's refusal
            code = int(exc.code or 0)
        assert code == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err
        assert "insecure" not in err
    with pytest.raises(InvalidArgument, match="TLS: ca is not PEM"):
        TLSOptions(ca=b"hello")
    with pytest.raises(InvalidArgument, match="TLS: ca holds no certificate .*a private key"):
        TLSOptions(ca=key.read_bytes())  # (a raw ssl.SSLError from Client)
    with pytest.raises(InvalidArgument, match="TLS: cert holds no certificate"):
        TLSOptions(cert=key.read_bytes(), key=key.read_bytes())
    damaged = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    with pytest.raises(InvalidArgument, match="TLS: ca is not a certificate the ssl module"):
        Client("127.0.0.1:1", tls=TLSOptions(ca=damaged))
    with pytest.raises(InvalidArgument, match=r"TLS: ca is the PEM's bytes .*a file's path"):
        TLSOptions(ca="/etc/kdn/ca.pem")  # (a raw TypeError)
    pem = "-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"
    assert TLSOptions(ca=pem).ca == pem.encode()  # PEM read as text is taken as its bytes
    with pytest.raises(InvalidArgument, match="api_key must be printable ASCII"):
        Client("127.0.0.1:1", api_key=" key")
    monkeypatch.setattr(sys, "stdout", None)  # started with stdout closed (`>&-`)
    assert cli(["admin", "fleet", "--nodes", "127.0.0.1:1", "--timeout", "1"]) == 1



def _raw_grpc_call(port: int, headers: list[tuple[bytes, bytes]]) -> None:
    """A Lookup over plain HTTP/2 with ``headers`` as given (no gRPC library checks them)."""
    import socket
    import struct

    def frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
        return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + \
            struct.pack(">I", stream) + payload

    def literal(name: bytes, value: bytes) -> bytes:  # HPACK, no indexing, lengths < 127
        return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value

    block = b"".join(literal(k, v) for k, v in [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/kdn.v1.KDN/Lookup"),
        (b":authority", b"127.0.0.1"), (b"content-type", b"application/grpc"),
        (b"te", b"trailers"), *headers])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + frame(4, 0, 0, b"") +
                  frame(1, 0x4, 1, block) + frame(0, 0x1, 1, b"\x00" * 5))
        s.settimeout(1)  # the answer comes at once; the connection stays open
        with contextlib.suppress(OSError):
            while s.recv(65536):
                pass


def test_kdn_serve_in_json_writes_json_lines_only(tmp_path: Path) -> None:
    """A caller's malformed ``grpc-timeout`` header made gRPC's C core write a plain-text
    ERROR line to ``kdn serve``'s stderr, one per call, amid ``--log-format json``'s lines."""
    import os
    import signal

    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    p = subprocess.Popen([sys.executable, "-m", "kdn", "serve", "--port", "0", "--disk-bytes",
                          "0", "--data-dir", str(tmp_path / "d"), "--log-format", "json",
                          "--log-level", "WARNING"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        found = re.search(r":(\d+)", p.stdout.readline() if p.stdout else "")
        assert found, "no ready line"
        _raw_grpc_call(int(found.group(1)), [(b"grpc-timeout", b"bogus")])
    finally:
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    assert all(line.startswith("{") for line in err.splitlines()), err


def test_an_api_key_starting_with_a_dash_is_taken(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """One ``secrets.token_urlsafe`` key in 64 starts with '-', which argparse took for an
    option: ``--api-key -Xq...`` was 'expected one argument'. It is the key now, and the
    example tenants file makes hex keys; a key left out is still named missing."""
    key = "-Xq3v9s0o2uQd8Zb1rT4yLw6mN5pK7jH0gF2eD4cB6a"
    auth = tmp_path / "tenants.yaml"
    auth.write_text(f'tenants:\n  ops: {{api_keys: ["{key}"], role: admin}}\n')
    auth.chmod(0o600)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                                   auth_file=str(auth))) as st:
        capsys.readouterr()
        assert cli(["admin", "stats", "--address", st.address, "--api-key", key]) == 0
        with pytest.raises(SystemExit) as out:
            cli(["admin", "stats", "--api-key", "--address", st.address])
        assert out.value.code == 2
        assert "--api-key: expected one argument" in capsys.readouterr().err
    example = (ROOT / "deploy" / "tenants.example.yaml").read_text()
    assert "token_hex(32)" in example and "token_urlsafe" not in example
