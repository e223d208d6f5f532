"""Config loading (file, KDN_* env, flags) and the ``kdn`` command line against a real process."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.errors import ConfigError, TierUnavailable
from kdn.server import ServerConfig, build_store
from kdn.server.config import _WHO_MAY_ENTER, load_config, parse_size
from kdn.store.tiered import WritePolicy
from tests.helpers import pruned_layout, random_kv
from tests.redis_servers import RedisServer


def test_precedence_file_env_flags(tmp_path: Path) -> None:
    f = tmp_path / "kdn.yaml"
    f.write_text("port: 6000\nram_bytes: 2GiB\ndata_dir: /tmp/x\n")
    cfg = load_config(f, env={"KDN_PORT": "7000", "KDN_DISK_BYTES": "3GB", "HOME": "/"},
                      flags={"data_dir": str(tmp_path), "port": None})
    assert cfg.port == 7000
    assert cfg.ram_bytes == 2 << 30 and cfg.disk_bytes == 3 * 10**9
    assert cfg.data_dir == tmp_path
    assert load_config(env={}, flags={"port": "1234"}).port == 1234


@pytest.mark.parametrize("source,match", [
    ({"env": {"KDN_PORT": "http"}}, "port: invalid value 'http' (from $KDN_PORT)"),
    ({"env": {"KDN_PORT": "70000"}}, "port: must be in 0..65535"),
    ({"flags": {"ram_bytes": "lots"}}, "ram_bytes: invalid value 'lots' (from --ram-bytes)"),
    ({"flags": {"log_level": "LOUD"}}, "log_level"),
    ({"flags": {"redis_url": "localhost:6379"}}, "redis_url"),
    ({"flags": {"redis_url": "redis://127.0.0.1:notaport"}}, "redis_url: redis://127.0.0.1:no"),
    ({"flags": {"redis_url": "redis://[::1"}}, "redis_url: redis://[::1 is not a valid URL"),
    ({"flags": {"redis_timeout_s": "nan"}}, "redis_timeout_s: must be a finite number"),
    ({"env": {"KDN_DEFAULT_TTL_S": "nan"}}, "default_ttl_s: must be a finite number"),
    ({"flags": {"shutdown_grace_s": "inf"}}, "shutdown_grace_s: must be a finite number"),
    ({"flags": {"disk_bytes": "1"}}, "disk_bytes: must be 0 (no disk tier) or at least 1MiB"),
    # gRPC holds durations in ms as a C int: 25 days were an OverflowError at start, and
    # 0.4 ms an idle timeout of 0 ms (every connection idle at once)
    ({"flags": {"idle_timeout_s": "2200000"}}, "idle_timeout_s: must be 0 or in "
                                               "0.001..2147483.647 seconds"),
    ({"flags": {"max_connection_age_s": "2147483.648"}}, "max_connection_age_s: must be 0 or"),
    ({"env": {"KDN_HANDSHAKE_TIMEOUT_S": "1e9"}}, "handshake_timeout_s: must be 0 or in"),
    ({"flags": {"idle_timeout_s": "0.0004"}}, "idle_timeout_s: must be 0 or in 0.001.."),
    ({"flags": {"max_connections": str(2**31)}}, "max_connections: must be in 0..2147483647"),
    ({"flags": {"max_streams_per_connection": "-1"}}, "max_streams_per_connection: must be in"),
    # 400 digits were an OverflowError traceback; 2**64 and more started, then broke Stats
    ({"env": {"KDN_RAM_BYTES": "1" + "0" * 400}}, "ram_bytes: invalid value '1000"),
    ({"env": {"KDN_RAM_BYTES": "1" + "0" * 400 + "GiB"}}, "at most 9223372036854775807 bytes"),
    ({"env": {"KDN_RAM_BYTES": "100000000TiB"}}, "at most 9223372036854775807 bytes (8 EiB)"),
    ({"flags": {"max_connections": "1" + "0" * 400}}, "max_connections: must be in"),
    ({"flags": {"idle_timeout_s": "1" + "0" * 400}}, "idle_timeout_s: must be"),
])
def test_bad_settings_are_named(source: dict, match: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=source.get("env", {}), flags=source.get("flags"))
    assert match in str(info.value)


@pytest.mark.parametrize("url", [
    "redis://:PW@127.0.0.1:0", "redis://u:PW@127.0.0.1:notaport", "redis://:PW@[::1:6379",
    "http://u:PW@127.0.0.1:6379", "redis://127.0.0.1:6379/1?PassWord=PW&x=1",
    ["redis://:PW@127.0.0.1:6379"],  # a YAML list: "invalid value" showed it
])
def test_a_redis_password_is_in_no_configuration_error(url: object) -> None:
    """A refused redis_url is shown without its password, the one in a ``?password=`` query
    option too (the URL was repr'd whole, and ``kdn serve`` printed it to the console)."""
    flags = {"redis_url": url, "redis_cluster": "true"}
    with pytest.raises(ConfigError, match="^redis_url: ") as info:
        load_config(env={}, flags=flags)
    assert "PW" not in str(info.value)
    if isinstance(url, str):
        with pytest.raises(ConfigError) as info:
            ServerConfig(redis_url=url, redis_cluster=True)
        assert "PW" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize("name,value", [("insecure", "false"), ("tracing", "false"),
                                        ("reuse_port", 0), ("log_level", 10),
                                        ("log_format", None)])
def test_settings_from_code_are_of_their_type(name: str, value: object) -> None:
    """ServerConfig from code: insecure="false" was true (API keys in plaintext off loopback
    taken), log_level=10 an AttributeError; load_config reads text as the CLI does."""
    with pytest.raises(ConfigError, match=f"^{name}: expected "):
        ServerConfig(**{name: value})  # type: ignore[arg-type]
    assert load_config(env={}, flags={"insecure": "false"}).insecure is False


def test_the_longest_durations_and_counts_allowed_are_what_grpc_takes() -> None:
    import grpc

    from kdn.server.app import grpc_options

    top = ServerConfig(idle_timeout_s=2147483.647, max_connection_age_s=2147483.647,
                       handshake_timeout_s=0.001, max_connections=2**31 - 1,
                       max_streams_per_connection=2**31 - 1)
    options = dict(grpc_options(top))
    assert options["grpc.max_connection_idle_ms"] == 2**31 - 1
    assert options["grpc.server_handshake_timeout_ms"] == 1
    grpc.server(None, options=list(options.items()))  # no OverflowError: every value a C int


def test_data_dir_from_code_may_be_a_string() -> None:
    assert ServerConfig(data_dir="some/where").data_dir == Path("some/where")
    with pytest.raises(ConfigError, match="data_dir: expected a folder's path"):
        ServerConfig(data_dir=5)  # type: ignore[arg-type]
    for source in ({"env": {"KDN_DATA_DIR": ""}}, {"flags": {"data_dir": " "}}):
        with pytest.raises(ConfigError, match="data_dir: .* must not be empty"):  # not the
            load_config(env=source.get("env", {}), flags=source.get("flags"))  # current folder
    with pytest.raises(ConfigError, match="data_dir: must not be empty"):
        ServerConfig(data_dir="")
    assert ServerConfig(data_dir=".").data_dir == Path(".")  # said so: taken


def test_a_write_policy_from_code_may_be_its_value() -> None:
    """ServerConfig(write_policy="write-through") was refused "expected one of
    ['write-through', 'write-behind'], got 'write-through'"; the value is its member."""
    for policy in WritePolicy:
        got = ServerConfig(write_policy=policy.value)  # type: ignore[arg-type]
        assert got.write_policy is policy and type(got.write_policy) is WritePolicy
    for bad in ("write-around", "WRITE-THROUGH", 1, None, ["write-through"]):
        with pytest.raises(ConfigError, match="^write_policy: expected one of"):
            ServerConfig(write_policy=bad)  # type: ignore[arg-type]


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="this host has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "[::1]"])
def test_an_ipv6_host_is_listened_on(host: str, tmp_path: Path) -> None:
    """``--host ::1`` (or ``[::1]``): the server listens on [::1]:PORT and serves (the address
    was '::1:0', which gRPC read as another; the brackets went to getaddrinfo)."""
    from kdn.server import ServerThread

    config = ServerConfig(host=host, port=0, data_dir=tmp_path / "d", disk_bytes=0)
    assert config.host == "::1" and config.address == "[::1]:0"
    with ServerThread(config) as server:
        assert server.address.startswith("[::1]:")
        with Client(server.address, timeout_s=10) as c:
            lay = pruned_layout()
            key, kv = keys.chunk_key([1, 2], lay), random_kv(lay, 4)
            c.store(key, kv)
            got = c.retrieve(key)
            assert got is not None and got.equal(kv)


def test_tiers_that_can_not_be_built_are_named_in_one_line(tmp_path: Path) -> None:
    """A Redis Cluster no node of which answers (redis-py learns its map at start), or a Redis
    that refuses the budget (CONFIG turned off), stops ``kdn serve`` with one line naming
    redis_url, or redis_bytes (exit 2), not a traceback; ``build_store`` raises the ConfigError
    the CLI prints. A Redis that does not answer yet takes the budget once it does (the tier starts
    down, as without a budget)."""
    url = f"redis://127.0.0.1:{_free_port()}"
    out = subprocess.run([sys.executable, "-m", "kdn", "serve", "--port", "0", "--data-port",
                          "-1", "--data-dir", str(tmp_path / "d"), "--redis-url", url,
                          "--redis-cluster", "true"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith("kdn serve: bad configuration: redis_url: ")
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1
    cfg = ServerConfig(data_dir=tmp_path / "d", redis_url=url, redis_bytes=1 << 30,
                       redis_timeout_s=0.5, redis_retries=0)
    store = build_store(cfg)
    try:
        with pytest.raises(TierUnavailable, match="does not answer: ConnectionError"):
            next(t for t in store.tiers if t.name == "redis").healthy()
    finally:
        store.close()
    with RedisServer(tmp_path, appendonly=False, extra=("--rename-command", "CONFIG", "")) as r:
        cfg = dataclasses.replace(cfg, redis_url=r.url)
        with pytest.raises(ConfigError, match="^redis_bytes: .*ResponseError: unknown command"):
            build_store(cfg)


def test_a_redis_url_option_redis_py_does_not_take_is_named(tmp_path: Path) -> None:
    """``?socket_timeuot=1`` (a typo) was a TypeError traceback from ``kdn serve``, exit 1."""
    cfg = ServerConfig(data_dir=tmp_path / "d", disk_bytes=0,
                       redis_url=f"redis://127.0.0.1:{_free_port()}?socket_timeuot=1")
    with pytest.raises(ConfigError, match="^redis_url: .*'socket_timeuot'"):
        build_store(cfg)


def test_yaml_null_is_unset_and_a_port_must_be_whole(tmp_path: Path) -> None:
    """``host: null`` became the host "None" (and a model, a certificate file named "None");
    ``port: 50051.9`` was cut to 50051 without a word."""
    f = tmp_path / "kdn.yaml"
    f.write_text("host: null\nmodel: null\ntls_cert:\ndata_dir: ~\nport: 6000.0\n")
    cfg = load_config(f, env={})
    assert (cfg.host, cfg.model, cfg.tls_cert, cfg.data_dir) == \
        ("127.0.0.1", "", "", ServerConfig().data_dir)
    assert cfg.port == 6000
    f.write_text("port: 50051.9\n")
    with pytest.raises(ConfigError, match=r"port: invalid value 50051.9 \(from .*kdn.yaml\): "
                                          "not a whole number"):
        load_config(f, env={})


def test_kdn_serve_without_a_disk_tier_says_so(tmp_path: Path) -> None:
    """The start line said "data in kdn-data" with --disk-bytes 0, where nothing is kept. With
    a disk tier it names the folder and the budget the tier took (cut where the disk holds
    less)."""
    for extra, says in ((["--disk-bytes", "0"], r"\(no disk tier\)$"),
                        (["--disk-bytes", "64MiB"],
                         re.escape(f"(data in {tmp_path / 'data'}, up to 64 MiB)") + "$")):
        proc = _serve(tmp_path, 0, "--data-port", "-1", *extra)
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().rstrip()
            assert line.startswith("kdn serving on 127.0.0.1:") and re.search(says, line), \
                line + (proc.stderr.read() if proc.poll() is not None and proc.stderr else "")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def test_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "kdn.yaml"
    f.write_text("prot: 1\n")
    with pytest.raises(ConfigError, match="prot: unknown setting"):
        load_config(f, env={})
    f.write_text("port: [1, 2\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(f, env={})
    with pytest.raises(ConfigError, match="config file"):
        load_config(tmp_path / "missing.yaml", env={})
    f.write_bytes(b"port: 50051\nhost: \xff\xfe\n")  # a UnicodeDecodeError traceback
    with pytest.raises(ConfigError, match="not UTF-8 text"):
        load_config(f, env={})
    f.write_text("port: 50051\n? [a, b]\n: 1\n")  # a list as a key: a TypeError traceback
    with pytest.raises(ConfigError, match="(?s)not valid YAML.*unhashable key"):
        load_config(f, env={})


def test_a_settings_file_that_never_ends_is_refused_unread(tmp_path: Path) -> None:
    """``--config /dev/zero`` (or a fleet file): read up to a bound and refused, naming it (it
    grew until memory ran out: a MemoryError traceback); a pipe is still read as a file."""
    from kdn.client.fleet import FleetConfig

    with pytest.raises(ConfigError, match="config file /dev/zero: larger than 4 MiB"):
        load_config(Path("/dev/zero"), env={})
    with pytest.raises(ConfigError, match="fleet file /dev/zero: larger than 4 MiB"):
        FleetConfig.from_file(Path("/dev/zero"))
    r, w = os.pipe()
    os.write(w, b"port: 50123\n")
    os.close(w)
    try:
        assert load_config(Path(f"/dev/fd/{r}"), env={}).port == 50123
    finally:
        os.close(r)


@pytest.mark.parametrize("text,match", [
    ("data_dir: [a, b]\n", r"data_dir: invalid value \['a', 'b'\] .* expected a path"),  # a
    ("host: [x]\n", r"host: invalid value \['x'\] .* expected text"),  # folder "['a', 'b']"
    ("host: true\n", "host: invalid value True .* expected text"),  # the text "True"
    ("data_dir: no\n", "data_dir: invalid value False .* expected a path"),  # a folder "False"
    ("idle_timeout_s: true\n", "idle_timeout_s: invalid value True .* expected a number"),
    ("port: {a: 1}\n", "port: invalid value {'a': 1} .* expected a whole number"),
    ("allowed_models: [[a]]\n", "allowed_models: invalid value .* a list of names"),
])
def test_a_setting_of_the_wrong_shape_is_refused_not_turned_into_text(
        tmp_path: Path, text: str, match: str) -> None:
    f = tmp_path / "kdn.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(f, env={})


def test_a_yaml_alias_bomb_is_refused_in_one_short_line(tmp_path: Path) -> None:
    """Nine levels of ten aliases: 10**9 items once written out; the error printed the value
    whole (gigabytes, a MemoryError after half a minute)."""
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]")
    f = tmp_path / "kdn.yaml"
    f.write_text("\n".join(lines[:-1]) + "\nhost: " + lines[-1].split(": ", 1)[1] + "\n")
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as info:
        load_config(f, env={})
    assert time.monotonic() - t0 < 10 and len(str(info.value)) < 1000


def test_a_variable_overriding_a_file_setting_is_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The server image's ENV (KDN_PORT, KDN_METRICS_PORT, ...) beats a mounted config file;
    each setting of the file a variable overrides is a warning naming both (it was silent: the
    file's metrics_port: -1 left /metrics open). A variable equal to the file's value, or one
    a flag overrides in turn, says nothing."""
    f = tmp_path / "kdn.yaml"
    f.write_text("port: 6000\nmetrics_port: -1\nram_bytes: 64MiB\n")
    with caplog.at_level("WARNING", logger="kdn.server.config"):
        cfg = load_config(f, env={"KDN_PORT": "50051", "KDN_METRICS_PORT": "9464",
                                  "KDN_RAM_BYTES": "64MiB"}, flags={"port": 7000})
    assert (cfg.port, cfg.metrics_port) == (7000, 9464)
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1, said
    assert said[0].startswith("metrics_port: $KDN_METRICS_PORT (9464) overrides -1 in ") \
        and str(f) in said[0], said


def test_an_overriding_redis_url_is_warned_of_without_its_password(tmp_path: Path) -> None:
    """The override warning names both URLs, as connections show them: without passwords
    (it printed a KDN_REDIS_URL whole, password and all, into the server's log)."""
    f = tmp_path / "kdn.yaml"
    f.write_text("redis_url: redis://:filesecret@127.0.0.1:6390/0\n")
    notes: list[str] = []
    cfg = load_config(f, env={"KDN_REDIS_URL": "redis://:envsecret@127.0.0.1:6391/0"},
                      notes=notes)
    assert "envsecret" in cfg.redis_url
    assert len(notes) == 1 and "6391" in notes[0] and "6390" in notes[0], notes
    assert "secret" not in notes[0], notes


def test_the_override_warnings_come_in_the_logs_format(tmp_path: Path) -> None:
    """Under log_format: json every line kdn serve logs is JSON: the override warnings were
    logged before logging was set up (a bare text line in the stream), a path shown as
    PosixPath('/data'); now they come after, as values are written."""
    f = tmp_path / "kdn.yaml"
    f.write_text(f"data_dir: {tmp_path / 'file'}\nram_bytes: 64MiB\nlog_format: json\n"
                 "data_port: -1\nmetrics_port: -1\ndisk_bytes: 0\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
    env["KDN_DATA_DIR"] = str(tmp_path / "env")
    proc = subprocess.Popen([sys.executable, "-m", "kdn", "serve", "--config", str(f),
                             "--port", "0"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith("kdn serving on")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        lines = proc.stderr.read().splitlines()
    finally:
        proc.kill()
        proc.wait()
    logged = [json.loads(line) for line in lines]  # each line JSON
    (warning,) = [r for r in logged if r["logger"] == "kdn.server.config"]
    assert warning["level"] == "WARNING" and warning["msg"].startswith(
        f"data_dir: $KDN_DATA_DIR ({tmp_path / 'env'}) overrides {tmp_path / 'file'} in "), \
        warning


def test_parse_size() -> None:
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("1.5GiB") == int(1.5 * (1 << 30))
    assert parse_size(42) == 42
    with pytest.raises(ValueError):
        parse_size("12 parsecs")
    assert parse_size((1 << 63) - 1) == (1 << 63) - 1
    for bad in (1 << 63, "8EiB", "1" + "0" * 400, [1], {"a": 1}):
        with pytest.raises(ValueError):
            parse_size(bad)
    assert parse_size(2.0) == 2 and parse_size("1.5KB") == 1500


@pytest.mark.parametrize("value", [1.5, 0.5, "1.5", "0.5B"])
def test_a_fraction_of_a_byte_is_refused(value: object) -> None:
    """A byte count with a fraction and no unit above bytes (YAML's ``ram_bytes: 1.5``) is
    refused; it was cut to a whole byte (1.5: 1 byte; 0.5: "got 0")."""
    with pytest.raises(ValueError, match="a whole number of bytes"):
        parse_size(value)
    with pytest.raises(ConfigError, match="ram_bytes: .*a whole number of bytes"):
        load_config(None, env={"KDN_RAM_BYTES": str(value)})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_serving(address: str, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.time() + timeout
    with Client(address, timeout_s=2) as c:
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError(f"server exited: {proc.stderr.read() if proc.stderr else ''}")
            try:
                if c.health() == "SERVING":
                    return
            except Exception:
                time.sleep(0.1)
    raise AssertionError("server never became healthy")


def _serve(tmp_path: Path, port: int, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, KDN_RAM_BYTES="64MiB")
    return subprocess.Popen(
        [sys.executable, "-m", "kdn", "serve", "--port", str(port),
         "--data-dir", str(tmp_path / "data"), *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_kdn_serve_stops_gracefully_on_a_sigterm_right_after_its_ready_line(
        tmp_path: Path) -> None:
    """A supervisor that stops the server as soon as it printed "kdn serving on": a graceful
    stop, exit 0 (the handler came after the line: killed by the signal, exit -15). SIGHUP
    (a closing terminal's) too, saying so (it killed the server outright, exit -1)."""
    for i, sig in enumerate([signal.SIGTERM] * 3 + [signal.SIGHUP] * 2):  # (a race: not
        proc = _serve(tmp_path / str(i), 0, "--disk-bytes", "0", "--log-level", "WARNING")
        try:  # every try lost it)
            assert proc.stdout is not None
            assert proc.stdout.readline().startswith("kdn serving on")
            proc.send_signal(sig)
            assert proc.wait(30) == 0
            if sig is signal.SIGHUP:
                assert proc.stderr is not None and "SIGHUP: stopping gracefully" in \
                    proc.stderr.read()
        finally:
            proc.kill()
            proc.communicate()


def test_kdn_serve_process_graceful_shutdown_and_restart(tmp_path: Path) -> None:
    port = _free_port()
    address = f"127.0.0.1:{port}"
    proc = _serve(tmp_path, port)
    lay = pruned_layout()
    kv = random_kv(lay, 24)
    key = keys.chunk_key([1, 2, 3], lay)
    try:
        _wait_serving(address, proc)
        with Client(address) as c:
            c.store(key, kv)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        proc.kill()
    proc = _serve(tmp_path, port)
    try:
        _wait_serving(address, proc)
        with Client(address) as c:
            back = c.retrieve(key, layout=lay)
            assert back is not None and back.equal(kv)
        out = subprocess.run([sys.executable, "-m", "kdn", "admin", "--address", address,
                              "--json", "stats"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and '"disk"' in out.stdout
        out = subprocess.run([sys.executable, "-m", "kdn", "admin", "--address", address,
                              "lookup", key.hex()], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "present" in out.stdout
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0


def test_kdn_serve_rejects_bad_config(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kdn", "serve", "--port", "-5"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "port" in out.stderr
    out = subprocess.run([sys.executable, "-m", "kdn", "serve"], capture_output=True, text=True,
                         timeout=60, env=dict(os.environ, KDN_RAM_BYTES="huge"))
    assert out.returncode == 2 and "ram_bytes" in out.stderr and "KDN_RAM_BYTES" in out.stderr


@pytest.mark.parametrize("name", ["auth_file", "auth_tenants", "tls_client_ca"])
def test_a_setting_that_lets_callers_in_given_empty_fails_closed(name: str,
                                                                 tmp_path: Path) -> None:
    """KDN_AUTH_TENANTS= (a Secret that came out empty) was read as unset: the server started
    with authentication off. Empty or blank, from a variable, the file or a flag, it is
    refused naming the setting; unset (or YAML null) still means none."""
    var = f"KDN_{name.upper()}"
    for value in ("", "  "):
        with pytest.raises(ConfigError, match=rf"{name}: \${var} is given but empty"):
            load_config(env={var: value})
        with pytest.raises(ConfigError, match=rf"{name}: --{name.replace('_', '-')} is given "
                                              "but empty"):
            load_config(env={}, flags={name: value})
    conf = tmp_path / "kdn.yaml"
    conf.write_text(f'{name}: ""\n')
    with pytest.raises(ConfigError, match=rf"{name}: {conf} is given but empty"):
        load_config(conf, env={})
    conf.write_text(f"{name}:\n")
    assert getattr(load_config(conf, env={}), name) == ""
    out = subprocess.run([sys.executable, "-m", "kdn", "serve", "--port", "0"],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, var: ""})
    assert out.returncode == 2 and f"${var} is given but empty" in out.stderr, out.stderr


def test_admin_against_nothing_fails_cleanly() -> None:
    out = subprocess.run([sys.executable, "-m", "kdn", "admin", "--address",
                          f"127.0.0.1:{_free_port()}", "--timeout", "2", "health"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "UNAVAILABLE" in out.stderr


def test_a_mistyped_variable_is_refused_with_the_setting_it_meant() -> None:
    with pytest.raises(ConfigError, match=r"\$KDN_RAM_BYTS: no such setting; did you mean "
                                          r"KDN_RAM_BYTES\?"):
        load_config(env={"KDN_RAM_BYTS": "1GiB"})
    with pytest.raises(ConfigError, match=r"\$KDN_WHATEVER: no such setting; `kdn serve"):
        load_config(env={"KDN_WHATEVER": "1"})
    # the variables of kdn's clients and scripts are not settings and pass
    cfg = load_config(env={"KDN_ADDRESS": "10.0.0.1:1", "KDN_API_KEY": "k", "KDN_PORT": "7"})
    assert cfg.port == 7


def test_kubernetes_service_links_are_not_settings(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A pod beside a Service named kdn gets KDN_SERVICE_HOST, KDN_PORT=tcp://IP:PORT,
    KDN_PORT_<N>_TCP... (service links): they were refused as settings (`kdn serve` exit 2,
    and `kdn admin health`, the probes, too); now skipped, and KDN_PORT of that form is not
    the port (the file's is), with a warning naming enableServiceLinks."""
    ip = "10.96.0.42"
    links = {"KDN_SERVICE_HOST": ip, "KDN_SERVICE_PORT": "50051",
             "KDN_SERVICE_PORT_GRPC": "50051", "KDN_PORT": f"tcp://{ip}:50051"}
    for port in (50051, 9464):
        base = f"KDN_PORT_{port}_TCP"
        links.update({base: f"tcp://{ip}:{port}", base + "_PROTO": "tcp",
                      base + "_PORT": str(port), base + "_ADDR": ip})
    from kdn.server.config import check_variables

    check_variables(links)
    f = tmp_path / "kdn.yaml"
    f.write_text("port: 50071\n")
    with caplog.at_level("WARNING", logger="kdn.server.config"):
        cfg = load_config(f, env={**links, "KDN_DATA_PORT": "50075"})
    assert (cfg.port, cfg.data_port) == (50071, 50075)
    assert any("enableServiceLinks: false" in r.getMessage() for r in caplog.records)
    assert load_config(env=links).port == 50051  # the default
    with pytest.raises(ConfigError, match=r"\$KDN_SERVICE_HOSTS: no such setting"):
        load_config(env={"KDN_SERVICE_HOSTS": ip})
    with pytest.raises(ConfigError, match=r"port: invalid value"):
        load_config(env={"KDN_PORT": "http://10.0.0.1:50051/x"})


def test_help_shows_values_as_one_writes_them() -> None:
    from kdn.server.config import ServerConfig, describe, format_size

    shown = {name: (default, doc) for name, default, doc in describe()}
    assert shown["ram_bytes"][0] == "1GiB" and shown["disk_bytes"][0] == "16GiB"
    assert shown["redis_cluster"][0] == "false" and shown["redis_url"][0] == '""'
    assert "ram" in shown["tier_order"][0] and "(" not in shown["tier_order"][0]
    assert all(doc for _, doc in shown.values())  # every setting documented
    assert "api_keys" in shown["auth_file"][1] and "kdn/server" not in shown["auth_file"][1]
    assert format_size(3 << 20) == "3MiB" and format_size(1000) == "1000"
    for name, default, _ in describe():  # what help shows parses back to the default
        if name in _WHO_MAY_ENTER:  # "" is unset there: given empty, it is refused
            continue
        flags = {name: default if default != '""' else ""}
        assert getattr(load_config(env={}, flags=flags), name) == \
            getattr(ServerConfig(), name), name


def test_every_kdn_variable_the_code_or_docs_name_is_known() -> None:
    """Each ``KDN_*`` environment variable kdn's code, scripts or docs read or name is a server
    setting or one of ``OTHER_VARIABLES``: ``kdn serve``/``admin``/``rag`` refuse any other as
    a typo (KDN_MALLOC_TUNING and KDN_REAL_KV, documented, stopped them with exit 2)."""
    import dataclasses
    import re
    import subprocess

    from kdn.server.config import OTHER_VARIABLES, ServerConfig, check_variables

    root = Path(__file__).resolve().parents[1]
    files = subprocess.run(["git", "ls-files", "kdn", "scripts", "bench", "deploy", "*.md",
                            "*.yml", "*.yaml"], cwd=root, capture_output=True, text=True,
                           check=True).stdout.split()
    named: set[str] = set()
    for f in files:
        text = (root / f).read_text(errors="replace")
        named |= set(re.findall(r"""[$"']\{?(KDN_[A-Z][A-Z0-9_]*[A-Z0-9])\b""", text))
        named |= set(re.findall(r"\b(KDN_[A-Z][A-Z0-9_]*[A-Z0-9])=", text))  # KDN_X=value
    settings = {"KDN_" + f.name.upper() for f in dataclasses.fields(ServerConfig)}
    assert {"KDN_MALLOC_TUNING", "KDN_ADDRESS", "KDN_DATA_DIR"} <= named  # the scan sees them
    assert sorted(named - settings - OTHER_VARIABLES) == []
    check_variables(dict.fromkeys(named, "1"))
