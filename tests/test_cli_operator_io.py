"""``kdn admin`` where its files, pipes and terminal are not the plain ones: an export into
standard output (``export /dev/stdout > backup.kdnx``) is an export file and nothing else, a
server's error text reaches the terminal escaped, and a server that never answers ends an
export after ``--timeout``."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn import keys
from kdn.cli.main import main as cli
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout

ROOT = Path(__file__).resolve().parent.parent
LAY = uniform_layout(layers=2, heads=2, dim=8)
ENV = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}


def kdn(*argv: str, **kwargs: object) -> subprocess.CompletedProcess[bytes]:
    """``python -m kdn ARGV`` in a process of its own (its stdout is a real file or pipe)."""
    return subprocess.run([sys.executable, "-m", "kdn", *argv], cwd=ROOT, env=ENV, timeout=60,
                          **kwargs)  # type: ignore[call-overload, no-any-return]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server holding 5 entries in namespace ``kb``; its address."""
    tmp = tmp_path_factory.mktemp("operator_io")
    with ServerThread(ServerConfig(port=0, data_dir=tmp / "data", disk_bytes=0)) as server:
        with Client(server.address) as c:
            for i in range(5):
                c.store(keys.chunk_key([i, 1], LAY), random_kv(LAY, 8, seed=i), namespace="kb")
        yield server.address


def test_an_export_into_stdout_is_the_export_file_alone(live: str, tmp_path: Path) -> None:
    """``export /dev/stdout > f`` and ``export /dev/stdout | cat > f``: the summary goes to
    stderr (it overwrote the file's header, or followed its end marker), and ``f`` imports."""
    to_file = tmp_path / "to_file.kdnx"
    with open(to_file, "wb") as f:
        done = kdn("admin", "export", "/dev/stdout", "--address", live, stdout=f,
                   stderr=subprocess.PIPE)
    assert done.returncode == 0, done.stderr
    assert b"entries: 5" in done.stderr
    to_pipe = tmp_path / "to_pipe.kdnx"
    with open(to_pipe, "wb") as f:
        cat = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=f)
        done = kdn("admin", "export", "/dev/stdout", "--address", live, "-o", "json",
                   stdout=cat.stdin, stderr=subprocess.PIPE)
        assert cat.stdin is not None
        cat.stdin.close()
        cat.wait(timeout=30)
    assert done.returncode == 0, done.stderr
    assert b'"entries": 5' in done.stderr
    for path in (to_file, to_pipe):
        assert cli(["admin", "import", str(path), "--address", live]) == 0, path


def test_an_export_into_a_pipe_whose_reader_left_fails(tmp_path: Path) -> None:
    """``export /dev/stdout | head -c 1000``: exit 1, the file named as cut off. It opened
    the pipe to read too, so it never had EPIPE and hung once the pipe was full (and an EPIPE
    was main's quiet exit 0 of ``ls | head``)."""
    big = uniform_layout(layers=4, heads=8, dim=64)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0)) as server:
        with Client(server.address) as c:
            for i in range(8):  # 8 x 128 KiB: more than a pipe holds
                c.store(keys.chunk_key([i, 2], big), random_kv(big, 16, seed=i))
        head = subprocess.Popen(["head", "-c", "1000"], stdin=subprocess.PIPE,
                                stdout=subprocess.DEVNULL)
        assert head.stdin is not None
        done = kdn("admin", "export", "/dev/stdout", "--address", server.address,
                   stdout=head.stdin, stderr=subprocess.PIPE)
        head.stdin.close()
        head.wait(timeout=10)
    assert done.returncode == 1, done.stderr
    assert b"/dev/stdout: its reader left; what it read is cut off" in done.stderr, done.stderr


def test_a_servers_error_text_reaches_the_terminal_escaped(
        capsys: pytest.CaptureFixture[str]) -> None:
    """A peer whose error details hold terminal escapes (a window title, clear screen,
    colours): the error line shows them escaped, as table cells do."""
    from concurrent import futures

    import grpc

    evil = "boom\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED\x1b[0m\u00e9"

    class Refuse(grpc.GenericRpcHandler):
        def service(self, details: object) -> grpc.RpcMethodHandler:
            def unary(req: bytes, ctx: grpc.ServicerContext) -> None:
                ctx.abort(grpc.StatusCode.INTERNAL, evil)
            return grpc.unary_unary_rpc_method_handler(unary)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((Refuse(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        code = cli(["admin", "stats", "--address", f"127.0.0.1:{port}", "--timeout", "5"])
    finally:
        server.stop(0)
    err = capsys.readouterr().err
    assert code == 1
    assert "\x1b" not in err and "\x07" not in err, ascii(err)
    assert "boom\\x1b]0;PWNED\\x07\\x1b[2J" in err and "\u00e9" in err, err
    assert len(err.splitlines()) == 1


def test_an_export_from_a_server_that_never_answers_ends_after_timeout(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A server that takes the Export call and sends nothing (a hung node): the export ends
    after ``--timeout`` (the stream has no deadline in all, but each item one), exit 1."""
    import threading
    import time
    from concurrent import futures

    import grpc

    release = threading.Event()

    class Silent(grpc.GenericRpcHandler):
        def service(self, details: object) -> grpc.RpcMethodHandler:
            def stream(req: bytes, ctx: grpc.ServicerContext) -> Iterator[bytes]:
                release.wait(30)
                return iter(())
            return grpc.unary_stream_rpc_method_handler(stream)

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((Silent(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        t0 = time.monotonic()
        code = cli(["admin", "export", str(tmp_path / "x.kdnx"), "--address",
                    f"127.0.0.1:{port}", "--timeout", "1"])
        took = time.monotonic() - t0
    finally:
        release.set()
        server.stop(0)
    err = capsys.readouterr().err
    assert code == 1, err
    assert took < 10, took
    assert "sent nothing for 1 seconds" in err and "raise --timeout" in err, err


def test_only_a_reader_that_left_is_taken_for_a_closed_pipe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``| head`` exits 0 quietly (``test_cli_newcomer``), but only where standard output is
    what broke: a broken pipe of another connection is not mistaken for it."""
    from kdn.cli.main import _stdout_gone

    r, w = os.pipe()
    with open(w, "w") as out:
        monkeypatch.setattr(sys, "stdout", out)
        assert not _stdout_gone()  # a reader is there
        os.close(r)
        assert _stdout_gone()
        monkeypatch.undo()


def test_fleet_takes_the_tls_options_as_every_admin_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``kdn admin fleet --tls-ca CA``: the node is SERVING, as ``health`` with the same
    options says (the options were ignored: DOWN, exit 1); a TLS file missing is a usage
    error naming it."""
    from tests.helpers import make_certs

    certs = make_certs(tmp_path)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                       tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]))
    with ServerThread(cfg) as server:
        tls = ["--tls-ca", str(certs["ca.crt"]), "--timeout", "5"]
        assert cli(["admin", "health", "--address", server.address, *tls]) == 0
        capsys.readouterr()
        code = cli(["admin", "fleet", "--nodes", server.address, *tls, "-o", "json"])
        out = capsys.readouterr()
        assert code == 0, out
        assert '"status": "SERVING"' in out.out
        missing = str(tmp_path / "nope.crt")
        assert cli(["admin", "fleet", "--nodes", server.address, "--tls-ca", missing]) == 2
        err = capsys.readouterr().err
        assert missing in err and "--tls-*" in err and len(err.splitlines()) == 1, err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full here")
def test_a_file_that_can_not_be_written_is_a_failure_naming_it(
        live: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """An export whose disk filled (/dev/full): exit 1, the file named (exit 2, usage, and
    ``[Errno 28] ...`` alone); an import of a pipe: refused as no regular file, not "no such
    file"; a folder that does not exist is still a usage mistake."""
    assert cli(["admin", "export", "/dev/full", "--address", live]) == 1
    err = capsys.readouterr().err
    assert "kdn admin export: /dev/full: No space left on device" in err, err
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert cli(["admin", "import", str(fifo), "--address", live]) == 2
    err = capsys.readouterr().err
    assert f"{fifo}: not a regular file" in err and "no such file" not in err, err
    missing = tmp_path / "nowhere" / "x.kdnx"
    assert cli(["admin", "export", str(missing), "--address", live]) == 2
    assert str(missing) in capsys.readouterr().err


def test_a_tls_mismatch_is_one_line_that_says_so(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A CA that did not sign the server's certificate: one line (gRPC's native log lines,
    one per try, came first), its hint about TLS, not "is a kdn server listening?"; plaintext
    to a TLS-only server: a hint to pass --tls-ca."""
    from tests.helpers import make_certs

    certs = make_certs(tmp_path)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", disk_bytes=0,
                       tls_cert=str(certs["server.crt"]), tls_key=str(certs["server.key"]))
    env = {k: v for k, v in ENV.items() if not k.startswith("GRPC_")}
    with ServerThread(cfg) as server:
        done = subprocess.run([sys.executable, "-m", "kdn", "admin", "stats", "--address",
                               server.address, "--tls-ca", str(certs["client.crt"]),
                               "--timeout", "5"], cwd=ROOT, env=env, timeout=60,
                              capture_output=True, text=True)
        assert done.returncode == 1
        assert len(done.stderr.splitlines()) == 1, done.stderr
        assert "the TLS handshake failed: check --tls-ca" in done.stderr, done.stderr
        assert cli(["admin", "stats", "--address", server.address, "--timeout", "5"]) == 1
        err = capsys.readouterr().err
        assert "does it take TLS only? (pass --tls-ca" in err, err


def test_a_bad_address_from_the_environment_names_the_variable(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed $KDN_ADDRESS is refused naming it (it read "argument --address", which the
    user had not passed); an --address given wins over it."""
    monkeypatch.setenv("KDN_ADDRESS", "garbage")
    with pytest.raises(SystemExit) as exited:
        cli(["admin", "stats"])
    err = capsys.readouterr().err
    assert exited.value.code == 2
    assert "$KDN_ADDRESS: address 'garbage' has no port" in err and "--address:" not in err
    assert len(err.splitlines()) == 1, err
    with pytest.raises(SystemExit) as exited:  # kdn rag reads the same variable
        cli(["rag", "ask", "a question"])
    assert exited.value.code == 2
    assert "kdn rag: $KDN_ADDRESS: address 'garbage'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exited:  # the flag's own mistake still names the flag
        cli(["admin", "stats", "--address", "nope"])
    assert "argument --address: address 'nope'" in capsys.readouterr().err
    assert cli(["admin", "stats", "--address", "127.0.0.1:1", "--timeout", "1"]) == 1
