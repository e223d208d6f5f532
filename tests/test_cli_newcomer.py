"""The CLI as a new user meets it (issue 56): every command refuses bad arguments with one line
and exit 2 (never a traceback), keys are taken by unique prefix as ``ls`` prints them, ``ls``
filters do what their help says, sizes are human in tables and numbers in JSON, misspelt
``KDN_*`` variables are caught by every command, a closed pipe is quiet, and ``kdn rag`` checks
the server and the question before it loads a model."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn import keys
from kdn.cli.main import main as cli
from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout

ROOT = Path(__file__).resolve().parent.parent
LOCAL_NAME = "/home/someone/models/SmolLM2-135M"  # a writer's local folder, as stored
LAY_A = dataclasses.replace(uniform_layout(layers=2, heads=2, dim=8, model="fp-aaaa"),
                            model_name=LOCAL_NAME)
LAY_B = dataclasses.replace(uniform_layout(layers=2, heads=2, dim=8, model="fp-bbbb"),
                            model_name="other-model")


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """``kdn ARGV`` in this process: (exit code, stdout, stderr)."""
    try:
        code = cli(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[str]]]:
    """A server holding 6 entries in namespace ``kb`` of two models; (address, hex keys)."""
    tmp = tmp_path_factory.mktemp("newcomer")
    with ServerThread(ServerConfig(port=0, data_dir=tmp / "data")) as server:
        hexes = []
        with Client(server.address) as c:
            for i in range(6):
                lay = LAY_A if i < 4 else LAY_B
                key = keys.chunk_key([i, i + 1], lay)
                c.store(key, random_kv(lay, 8, seed=i), namespace="kb", mode="raw")
                hexes.append(key.hex())
            c.store(keys.chunk_key([99], LAY_A), random_kv(LAY_A, 8), namespace="other")
        yield server.address, hexes


NO_SERVER = ["--address", "127.0.0.1:1"]  # a usage error must be found before any call
KEY = "ab" * 32
BAD = [  # (argv, words in the one stderr line)
    (["nosuch"], "invalid choice: 'nosuch'"),
    ([], "required: COMMAND"),
    (["--bogus"], "kdn: unrecognized arguments: --bogus"),  # (it said 'required: COMMAND')
    (["--jsn", "--bogus=1"], "kdn: unrecognized arguments: --jsn --bogus=1"),
    (["admin", "--bogus"], "kdn admin: unrecognized arguments: --bogus"),
    (["admin", "--json"], "kdn admin: the following arguments are required: COMMAND"),
    (["serve", "--port", "99999"], "port: must be in 0..65535"),
    (["serve", "--port", "50100", "--data-port", "50100"], "data_port: must differ from port"),
    (["serve", "--ram-bytes", "huge"], "ram_bytes"),
    (["serve", "--nosuch"], "unrecognized arguments: --nosuch"),
    (["serve", "--config", "/nonexistent/kdn.yaml"], "/nonexistent/kdn.yaml"),
    (["admin"], "required: COMMAND"),
    (["admin", "stats", "--address", "127.0.0.1"], "has no port"),
    (["admin", "stats", "--bogus"], "kdn admin stats: unrecognized arguments: --bogus"),
    (["rag", "ask", "hi", "--bogus"], "kdn rag ask: unrecognized arguments: --bogus"),
    (["admin", "stats", "--address", "127.0.0.1:99999"], "port must be in 1..65535"),
    (["admin", "stats", "--address", "127.0.0.1:0"], "port must be in 1..65535"),
    (["admin", "stats", "--address", "\udcff:1"], "lone surrogate"),  # argv byte 0xff
    (["serve", "--host", "\udcff", "--port", "0"], "host: host '\\udcff' is not a host name"),
    (["serve", "--metrics-host", "[\udcff]"], "metrics_host: host '\\udcff'"),
    (["admin", "stats", "--timeout", "1e12", *NO_SERVER], "at most 1000000 seconds"),
    (["admin", "stats", "--timeout", "0", *NO_SERVER], "must be > 0"),
    (["admin", "stats", "-o", "yaml", *NO_SERVER], "invalid choice: 'yaml'"),
    (["admin", "health", "--ready=yes", *NO_SERVER], "ignored explicit argument"),
    (["admin", "ls", "--limit", "5000000000", *NO_SERVER], "must be in 0..2147483647"),
    (["admin", "ls", "--limit", "-1", *NO_SERVER], "must be in 0..2147483647"),
    (["admin", "ls", "--prefix", "xyz", *NO_SERVER], "is malformed"),
    (["admin", "ls", "--namespace", "a b", *NO_SERVER], "is malformed"),
    (["admin", "ls", "--tenant", "UPPER", *NO_SERVER], "tenant"),
    (["admin", "inspect", "zz", *NO_SERVER], "key 'zz' is malformed"),
    (["admin", "inspect", "abc", *NO_SERVER], "at least 4"),
    (["admin", "inspect", *NO_SERVER], "required: KEY"),
    (["admin", "lookup", "ab" * 33, *NO_SERVER], "is malformed"),
    (["admin", "delete", "g" * 64, *NO_SERVER], "is malformed"),
    (["admin", "evict", KEY, "--tier", "nosuch", *NO_SERVER], "invalid choice: 'nosuch'"),
    (["admin", "pin", *NO_SERVER], "required: KEY"),
    (["admin", "unpin", KEY, "--namespace", "a b", *NO_SERVER], "is malformed"),
    (["admin", "verify", "--dry-run=1", *NO_SERVER], "ignored explicit argument"),
    (["admin", "export", *NO_SERVER], "required: FILE"),
    (["admin", "export", "{tmp}", *NO_SERVER], "is a directory"),
    (["admin", "import", "{tmp}", *NO_SERVER], "is a directory"),
    (["admin", "import", "/nonexistent/x.kdnx", *NO_SERVER], "no such file"),
    (["admin", "gc", "extra", *NO_SERVER], "unrecognized arguments: extra"),
    (["admin", "fleet", "--nodes", "127.0.0.1:1", "--fleet-file", "{tmp}"], "pass one of them"),
    (["rag"], "required: COMMAND"),
    (["rag", "ingest", *NO_SERVER], "required: corpus"),
    (["rag", "ingest", "/nonexistent/docs", "--state", "{tmp}", *NO_SERVER], "does not exist"),
    (["rag", "ingest", "README.md", "--state", "{tmp}", "--chunk-tokens", "x"], "whole number"),
    (["rag", "ingest", "README.md", "--address", ":50051"], "has no port"),
    (["rag", "ask", "hi", "--ratio", "2", *NO_SERVER], "must be in 0..1"),
    (["rag", "ask", "hi", "--state", "{tmp}", *NO_SERVER], "no corpus has been ingested"),
    (["rag", "rm", *NO_SERVER], "required: DOC"),
]


@pytest.mark.parametrize("argv, words", BAD, ids=[" ".join(a[:3]) or "(none)" for a, _ in BAD])
def test_bad_arguments_are_one_line_and_exit_2(argv: list[str], words: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code, out, err = run(argv, capsys)
    assert code == 2, (argv, err)
    assert len(err.strip().splitlines()) == 1, err
    assert words.lower() in err.lower(), err
    assert "Traceback" not in err and out == ""


def test_every_command_is_in_the_bad_argument_table() -> None:
    from kdn.cli.admin import ADMIN

    covered = {tuple(a[:2]) for a, _ in BAD}
    for cmd in ADMIN:
        assert ("admin", cmd) in covered, cmd
    for cmd in ("ingest", "ask", "rm"):
        assert ("rag", cmd) in covered, cmd
    assert any(a[:1] == ["serve"] for a, _ in BAD)


def test_version_is_printed_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    import kdn

    code, out, err = run(["--version"], capsys)
    assert (code, out, err) == (0, f"kdn {kdn.__version__}\n", "")


def test_keys_by_unique_prefix_as_ls_prints_them(live: tuple[str, list[str]],
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    address, hexes = live
    a = ["--address", address, "--namespace", "kb"]
    code, out, _ = run(["admin", "ls", *a], capsys)
    assert code == 0
    shown = re.findall(r"^kb\s+([0-9a-f]+)\s", out, flags=re.M)
    assert sorted(shown) == sorted(h[:12] for h in hexes)  # copyable: no ellipsis
    short = hexes[0][:12]
    code, out, err = run(["admin", "inspect", short, *a, "-o", "json"], capsys)
    assert code == 0, err
    assert json.loads(out)["key"] == hexes[0]
    for cmd, word in (("pin", "pinned"), ("unpin", "unpinned")):
        code, out, err = run(["admin", cmd, short, *a], capsys)
        assert (code, out.strip()) == (0, f"{word}: 1"), err
    code, out, _ = run(["admin", "lookup", short, "0000", *a, "-o", "json"], capsys)
    rows = json.loads(out)
    assert code == 1 and [r["present"] for r in rows] == [True, False]
    assert rows[0]["key"] == hexes[0]
    code, out, err = run(["admin", "evict", hexes[1][:8], *a, "--tier", "ram"], capsys)
    assert (code, out.strip()) == (0, "evicted: 1"), err
    # a prefix no key has: a failure (exit 1); one several keys share: usage (exit 2)
    absent = next(p for p in (f"{i:04x}" for i in range(65536))
                  if not any(h.startswith(p) for h in hexes))
    code, _, err = run(["admin", "delete", absent, *a], capsys)
    assert code == 1 and f"no entry whose key starts with {absent}" in err
    # two keys made to share their first 2 bytes: "abcd" is ambiguous, named with both
    twins = [bytes.fromhex("abcd" + d * 60) for d in "01"]
    with Client(address) as c:
        for k in twins:
            c.store(k, random_kv(LAY_B, 4), namespace="kb")
    code, _, err = run(["admin", "delete", "abcd", *a], capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "key prefix abcd is ambiguous" in err and twins[0].hex() in err and twins[1].hex() in err
    code, out, err = run(["admin", "delete", "abcd1", "abcd0", *a], capsys)
    assert (code, out.strip()) == (0, "deleted: 2"), err
    code, out, err = run(["admin", "delete", hexes[2][:10], *a], capsys)
    assert (code, out.strip()) == (0, "deleted: 1"), err


def test_an_empty_namespace_is_default_as_in_the_clients(
        live: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    """``--namespace ""`` of a per-key command is ``default``, as ``Client(namespace="")``
    (it was refused as malformed, exit 2); to ls it is every namespace."""
    address, hexes = live
    key = keys.chunk_key([7, 7], LAY_A)
    with Client(address, namespace="") as c:
        c.store(key, random_kv(LAY_A, 8), mode="raw")
    try:
        a = ["--address", address, "--namespace", ""]
        code, out, err = run(["admin", "inspect", key.hex(), *a, "-o", "json"], capsys)
        assert code == 0 and json.loads(out)["namespace"] == "default", err
        code, out, err = run(["admin", "ls", *a, "-o", "json"], capsys)
        assert code == 0 and {e["namespace"] for e in json.loads(out)} == {
            "default", "kb", "other"}, err
    finally:
        assert run(["admin", "delete", key.hex(), *a], capsys)[0] == 0


def test_ls_model_and_limit_do_what_the_help_says(live: tuple[str, list[str]],
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    address, hexes = live
    a = ["--address", address, "-o", "json"]

    def listed(*extra: str) -> list[dict[str, object]]:
        code, out, err = run(["admin", "ls", *a, *extra], capsys)
        assert code == 0, err
        return json.loads(out)  # type: ignore[no-any-return]

    everything = listed()
    assert {e["namespace"] for e in everything} == {"kb", "other"}
    n_a = sum(e["model_name"] == LOCAL_NAME for e in everything)
    assert n_a >= 2
    for model in (LOCAL_NAME, "SmolLM2-135M", "smollm2-135m", "fp-aaaa"[:4]):
        got = listed("--model", model)
        assert len(got) == n_a and all(e["model_name"] == LOCAL_NAME for e in got), model
    assert listed("--model", "nosuch") == []
    assert len(listed("--limit", "2")) == 2
    assert len(listed("--limit", "1", "--namespace", "kb")) == 1
    assert len(listed("--limit", "0")) == len(everything)
    code, out, _ = run(["admin", "ls", "--address", address, "--model", "smollm2-135m"], capsys)
    assert code == 0 and LOCAL_NAME not in out and "SmolLM2-135M" in out  # the name, no path


def test_sizes_are_human_in_tables_and_numbers_in_json(
        live: tuple[str, list[str]], capsys: pytest.CaptureFixture[str]) -> None:
    address, _ = live
    a = ["--address", address]
    code, out, _ = run(["admin", "stats", *a], capsys)
    assert code == 0
    assert re.search(r"^ram\s+\d+\s+\d+(\.\d)? (B|KiB)\s+1 GiB\s", out, flags=re.M), out
    assert "1073741824" not in out
    code, out, _ = run(["admin", "stats", *a, "-o", "json"], capsys)
    ram = next(t for t in json.loads(out)["tiers"] if t["name"] == "ram")
    assert ram["capacity_bytes"] == 1 << 30
    code, out, _ = run(["admin", "ls", *a, "--namespace", "kb"], capsys)
    assert re.search(r"\d+(\.\d)? (B|KiB)", out) and " size " in out.splitlines()[0] + " "
    from kdn.cli.output import human_size

    assert [human_size(n) for n in (0, 1023, 1536, 7_759_462, 17_179_869_184)] == [
        "0 B", "1023 B", "1.5 KiB", "7.4 MiB", "16 GiB"]


def test_misspelt_variables_are_caught_by_admin_and_rag(
        live: tuple[str, list[str]], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    address, _ = live
    monkeypatch.setenv("KDN_ADRESS", address)
    for argv in (["admin", "stats"], ["rag", "ask", "hi"], ["rag", "rm", "x"]):
        code, _, err = run(argv, capsys)
        assert code == 2, argv
        assert "$KDN_ADRESS: no such setting; did you mean KDN_ADDRESS?" in err, err
        assert len(err.strip().splitlines()) == 1
    monkeypatch.delenv("KDN_ADRESS")
    monkeypatch.setenv("KDN_API_KEY", "")
    assert run(["admin", "stats", "--address", address], capsys)[0] == 0


def test_a_closed_pipe_is_quiet(live: tuple[str, list[str]]) -> None:
    """``kdn admin ls | head -1``: no ``[Errno 32] Broken pipe``, no traceback, exit 0 (the
    reader here leaves before the first line is written; a reader that left is no failure:
    ``health``'s exit 1 means not SERVING)."""
    address, _ = live
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
    for argv in (["admin", "ls"], ["admin", "stats", "-o", "json"], ["admin", "health"]):
        proc = subprocess.Popen([sys.executable, "-m", "kdn", *argv, "--address", address],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                                env=env)
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
        assert err == "", err
        assert proc.returncode == 0, argv


def test_rag_checks_the_server_before_loading_torch_or_a_model(tmp_path: Path) -> None:
    """A down server is named at once, one line, exit 1, before torch or a model loads (the
    model's load took ~5 s first), and nothing is written to the state folder."""
    pytest.importorskip("torch")
    corpus = tmp_path / "docs"
    corpus.mkdir()
    (corpus / "a.txt").write_text("Paris is the capital of France.")
    probe = ("import sys\nfrom kdn.cli.main import main\ncode = main(sys.argv[1:])\n"
             "print(code, sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", probe, "rag", "ingest", str(corpus), "--state",
                           str(tmp_path / "st"), "--address", "127.0.0.1:1", "--timeout", "3"],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    print(f"down server reported after {time.perf_counter() - t0:.1f} s")
    assert proc.stdout.strip() == "1 []", (proc.stdout, proc.stderr)
    assert proc.stderr.count("\n") == 1 and "is a kdn server listening on 127.0.0.1:1" in \
        proc.stderr, proc.stderr
    assert not (tmp_path / "st").exists() or not any((tmp_path / "st").iterdir())


def test_model_names_the_cli_checks_are_the_model_sides() -> None:
    pytest.importorskip("transformers")
    from kdn.cli import args
    from kdn.model import embed, models

    assert (args.SMOLLM2_NAME, args.SMOLLM2_PACKAGE) == (models.SMOLLM2_NAME,
                                                         models.SMOLLM2_PACKAGE)
    assert {models.SMOLLM2_PACKAGE, embed.MINILM_PACKAGE} == set(args.PACKAGED)


def test_rag_refuses_an_empty_question(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from kdn.rag.index import Manifest, Settings

    Manifest(Settings("layout", "rag", 256, 384, "lossless", "")).save(tmp_path)
    for question in ("", "   \n"):
        code, _, err = run(["rag", "ask", question, "--state", str(tmp_path), *NO_SERVER],
                           capsys)
        assert code == 2 and "the question is empty" in err, err


@pytest.mark.parametrize("device,gpus,words", [
    ("cuda:7", 2, "this host has 2 CUDA devices (cuda:0 to cuda:1)"),
    ("cuda:1", 1, "this host has 1 CUDA device (cuda:0)"),
    ("gpu", 1, "'gpu' is not a device; use cpu, cuda or cuda:N"),
    ("cuda:x", 1, "'cuda:x' is not a device"),
])
def test_rag_refuses_a_device_the_host_does_not_have(
        device: str, gpus: int, words: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A device index past the host's GPUs failed late, in torch, after the model was loaded;
    a misspelt device ended in torch's RuntimeError, a traceback."""
    import argparse

    import torch

    from kdn.cli import rag

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    with pytest.raises(rag._UsageError, match=re.escape(words)):  # noqa: SLF001
        rag._device(argparse.Namespace(device=device))  # noqa: SLF001
    assert rag._device(argparse.Namespace(device="cuda:0")) == torch.device("cuda", 0)  # noqa: SLF001


TINY_RUN = """
import sys, tempfile
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from kdn.model import models
folder = tempfile.mkdtemp()
LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2)).save_pretrained(folder)
if sys.argv[1] == "quiet":
    models.quiet_transformers()
print("=== loading", file=sys.stderr, flush=True)
model = LlamaForCausalLM.from_pretrained(folder)
out = model(torch.tensor([[1, 2, 3]]), use_cache=True)
model(torch.tensor([[4]]), past_key_values=out.past_key_values, use_cache=True)
"""


def test_kdn_rag_silences_transformers_bars_and_warnings(tmp_path: Path) -> None:
    """What ``kdn rag`` calls before loading its model: no "Loading weights" bar and no
    ``past_key_values`` deprecation lines (two of each printed on every run before)."""
    pytest.importorskip("transformers")
    script = tmp_path / "tiny.py"
    script.write_text(TINY_RUN)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    said = {}
    for mode in ("loud", "quiet"):
        proc = subprocess.run([sys.executable, str(script), mode], capture_output=True,
                              text=True, cwd=tmp_path, env=env, timeout=300)
        assert proc.returncode == 0, proc.stderr
        said[mode] = proc.stderr.split("=== loading", 1)[1].strip()
    assert "deprecated" in said["loud"] and "Loading weights" in said["loud"]  # to silence
    assert said["quiet"] == ""


@pytest.mark.parametrize("flag", ["--port", "--data-port", "--metrics-port"])
def test_a_taken_port_is_one_line_naming_it(flag: str, tmp_path: Path) -> None:
    """No gRPC-native ``E… add_port.cc`` line, no bare ``[Errno 98]``: the port and the flag
    that picks another, exit 1."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        argv = ["serve", "--port", "0", "--data-dir", str(tmp_path / "d"), flag, str(taken)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KDN_")}
        proc = subprocess.run([sys.executable, "-m", "kdn", *argv], capture_output=True,
                              text=True, cwd=ROOT, env=env, timeout=120)
    finally:
        holder.close()
    assert proc.returncode == 1, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert f"127.0.0.1:{taken}" in proc.stderr and "Errno" not in proc.stderr
    assert ("with --port" if flag == "--port" else f"with {flag}") in proc.stderr


def test_an_unchanged_reingest_reports_nothing_computed() -> None:
    """Before: "stored 7.4 MiB" and a time per 1,000 tokens although nothing was computed."""
    pytest.importorskip("torch")
    from kdn.cli.rag import ingest_lines
    from kdn.rag.knowledge import IngestReport

    unchanged = IngestReport(documents=3, unchanged=3, chunks=3, tokens=56,
                             stored_bytes=7_759_462, total_s=0.4)
    (line,) = ingest_lines(unchanged)
    assert "computed 0 chunks" in line and "kdn holds 7.4 MiB for the corpus" in line
    assert "stored" not in line
    changed = dataclasses.replace(unchanged, changed=3, unchanged=0, computed=3,
                                  computed_tokens=2000, total_s=5.6)
    assert ingest_lines(changed)[1] == "ingest time per 1,000 tokens computed: 2.80 s"
    few = dataclasses.replace(changed, computed_tokens=31, total_s=2.6)
    assert len(ingest_lines(few)) == 1  # 31 tokens' fixed costs are no rate (it read 83.87 s)
