"""kdn.rag's settings and command line: ``RagConfig``'s fields and the ``kdn rag`` parser,
each refused where it is not what it must be (a request's own arguments: ``tests.test_rag``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kdn.errors import InvalidArgument
from kdn.rag import RagConfig


def test_config_validation() -> None:
    with pytest.raises(InvalidArgument):
        RagConfig(top_k=0)
    with pytest.raises(InvalidArgument):
        RagConfig(head="x")
    with pytest.raises(InvalidArgument):
        RagConfig(head="x", tail="no placeholder")
    for bad in (2.0, -0.1, True, "0.5"):
        with pytest.raises(InvalidArgument, match=f"blend_ratio must be a number in \\[0, 1\\], "
                                                  f"got {bad!r}"):
            RagConfig(blend_ratio=bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        RagConfig(namespace="bad ns")
    with pytest.raises(InvalidArgument, match="query_share"):
        RagConfig(query_share=1.5)
    assert RagConfig(query_share=0.0).blend_config().query_share == 0.0
    for bad in ("5", float("nan"), -1.0, float("inf"), True):  # "5" failed the ingest midway
        with pytest.raises(InvalidArgument, match=f"flush_s must be a finite number of seconds "
                                                  f">= 0, got {bad!r}"):
            RagConfig(flush_s=bad)  # type: ignore[arg-type]
    # whole numbers >= 1 only: no fraction, bool, text or zero
    for field, bad in (("top_k", 2.5), ("top_k", True), ("max_new_tokens", 1.5),
                       ("target_tokens", "256"), ("max_new_tokens", 0)):
        with pytest.raises(InvalidArgument, match=f"{field} must be a whole number >= 1, got "
                                                  f"{bad!r}"):
            RagConfig(**{field: bad})


def test_cli_parses_rag_commands() -> None:
    from kdn.cli.main import build_parser

    ns = build_parser().parse_args(["rag", "--state", "s", "ingest", "docs", "--mode", "kdn",
                                    "--level", "l2", "--chunk-tokens", "128"])
    assert (ns.cmd, ns.cmd_rag, ns.corpus, ns.mode, ns.level, ns.chunk_tokens) == (
        "rag", "ingest", "docs", "kdn", "l2", 128)
    ns = build_parser().parse_args(["rag", "ingest", "docs"])
    assert (ns.namespace, ns.chunk_tokens, ns.mode, ns.level) == (None, None, None, None)
    ns = build_parser().parse_args(["rag", "ask", "why?", "-k", "3"])
    assert (ns.question, ns.k, ns.selection) == ("why?", 3, None)
    ns = build_parser().parse_args(["rag", "ask", "why?", "--selection", "deviation"])
    assert ns.selection == "deviation"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["rag", "ask", "why?", "--selection", "random"])
    ns = build_parser().parse_args(["rag", "rm", "a.md", "b.md"])
    assert ns.docs == ["a.md", "b.md"]
    for option in ("-k", "--max-new-tokens"):  # 0 asked for the default (4 chunks, 32 tokens)
        with pytest.raises(SystemExit):
            build_parser().parse_args(["rag", "ask", "why?", option, "0"])
    ns = build_parser().parse_args(["rag", "ask", "why?"])
    assert (ns.k, ns.max_new_tokens) == (None, None)


def test_a_codec_mode_alone_is_its_default_level_and_unknown_ones_are_refused() -> None:
    assert RagConfig(mode="kdn").level == "default"  # what `kdn rag ingest --mode kdn` stores
    assert RagConfig(mode="int8").level == ""
    with pytest.raises(InvalidArgument, match="unknown codec mode 'zip'"):
        RagConfig(mode="zip")
    with pytest.raises(InvalidArgument, match="no level 'l2'"):
        RagConfig(mode="kdn", level="l2")


@pytest.mark.parametrize("sizes", [["--chunk-tokens", "4"],
                                   ["--chunk-tokens", "64", "--max-chunk-tokens", "10"]])
def test_chunk_sizes_ragconfig_refuses_are_usage_errors_before_any_call(
        sizes: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """They were found by RagConfig after the server's health call and the model load, and
    exited 1 (failed) instead of 2 (usage). No server listens on the address: the check comes
    before the first call."""
    from kdn.cli.main import main

    (tmp_path / "a.md").write_text("Cats purr.")
    assert main(["rag", "--address", "127.0.0.1:1", "--state", str(tmp_path / "state"),
                 "ingest", str(tmp_path), *sizes]) == 2
    assert "need 8 <= target_tokens <= max_tokens" in capsys.readouterr().err


@pytest.mark.parametrize("name, content", [("notes.pdf", b"%PDF-1.4"),
                                           ("docs.jsonl", b'{"id": 1}\n')])
def test_a_corpus_kdn_can_not_read_is_a_usage_error_before_any_call(
        name: str, content: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A corpus of the wrong kind (or lines that are no documents) is a usage mistake, as a
    missing corpus is: exit 2 naming the file, before the server's health call."""
    from kdn.cli.main import main

    (tmp_path / name).write_bytes(content)
    assert main(["rag", "--address", "127.0.0.1:1", "--state", str(tmp_path / "state"),
                 "ingest", str(tmp_path / name)]) == 2
    assert name in capsys.readouterr().err


@pytest.mark.parametrize("cmd", [["ingest", "docs"], ["ask", "Who?"], ["rm", "a.md"]])
def test_a_tls_ca_that_is_not_pem_is_a_usage_error_naming_it(
        cmd: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """As under kdn admin: exit 2 naming the file (it exited 1 with 'TLS: ca is not PEM')."""
    from kdn.cli.main import main
    from kdn.rag.index import Manifest, Settings

    ca, state, docs = tmp_path / "ca.pem", tmp_path / "state", tmp_path / "docs"
    ca.write_text("not a certificate\n")
    docs.mkdir()
    (docs / "a.md").write_text("Cats purr.")
    if cmd[0] != "ingest":  # ask and rm want an ingested state
        state.mkdir()
        Manifest(Settings("layout", "rag", 16, 20, "lossless", ""), owner="0f" * 16).save(state)
    assert main(["rag", "--address", "127.0.0.1:1", "--state", str(state), "--tls-ca", str(ca),
                 cmd[0], *([str(docs)] if cmd[0] == "ingest" else cmd[1:])]) == 2
    assert f"{ca}: not a PEM file" in capsys.readouterr().err


def test_an_api_key_in_plaintext_to_another_host_is_a_usage_error_naming_the_flags(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """As under kdn admin: exit 2 (it exited 1), hinting kdn rag's --tls-ca and KDN_INSECURE
    (it named Python's tls=TLSOptions(...) and insecure=True)."""
    from kdn.cli.main import main

    monkeypatch.delenv("KDN_INSECURE", raising=False)
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("Cats purr.")
    assert main(["rag", "--address", "10.1.2.3:50051", "--api-key", "k", "--state",
                 str(tmp_path / "state"), "ingest", str(tmp_path / "docs")]) == 2
    err = capsys.readouterr().err
    assert "in plaintext to 10.1.2.3:50051: pass --tls-ca" in err and "KDN_INSECURE=1" in err
    assert "TLSOptions" not in err


@pytest.mark.parametrize("cmd", [["ingest", "docs"], ["ask", "Who?"], ["rm", "a.md"]])
def test_an_empty_state_folder_is_a_usage_error_not_the_current_folder(
        cmd: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """KDN_RAG_STATE= (or --state "") made the current folder the state: ingest wrote its
    manifest, lock and embeddings there. No server listens: refused before any call."""
    from kdn.cli.main import build_parser, main

    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("Cats purr.")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("KDN_RAG_STATE", "")
    assert build_parser().parse_args(["rag", *cmd]).state == ""  # the variable, set but empty
    for flags in ([], ["--state", ""], ["--state", " "]):
        assert main(["rag", "--address", "127.0.0.1:1", *flags, *cmd]) == 2
        assert "must not be empty" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs"]


def test_a_plain_ingest_rerun_takes_the_states_settings() -> None:
    from kdn.cli.main import build_parser
    from kdn.cli.rag import ingest_settings
    from kdn.rag.index import Settings

    def settings(*flags: str, state: Settings | None = None) -> tuple[Any, ...]:
        ns = build_parser().parse_args(["rag", "ingest", "docs", *flags])
        ingest_settings(ns, state)
        return ns.namespace, ns.chunk_tokens, ns.max_chunk_tokens, ns.mode, ns.level

    assert settings() == ("rag", 256, 0, "lossless", "")
    old = Settings("layout", "team", 16, 20, "kdn", "small")
    assert settings(state=old) == ("team", 16, 20, "kdn", "small")
    assert settings("--chunk-tokens", "64", "--mode", "int8", state=old) == (
        "team", 64, 0, "int8", "")
    assert settings("--namespace", "x", "--level", "tiny", state=old) == (
        "x", 16, 20, "kdn", "tiny")


def test_a_state_write_the_disk_refuses_is_a_failure_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest the disk has no room for (here a write past RLIMIT_FSIZE: EFBIG, as ENOSPC
    would be): the OSError names the file, and ``kdn rag`` exits 1 (the command ran and
    failed), not 2 (a usage mistake) with "[Errno 28] No space left on device" alone."""
    import resource
    import signal

    from kdn.cli.main import build_parser
    from kdn.cli.rag import _run
    from kdn.rag.index import MANIFEST, write_atomic

    manifest = tmp_path / MANIFEST

    def commit(ns: Any) -> int:  # a command whose state commit meets a full disk
        handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))
        try:
            write_atomic(manifest, b"{}" * 8192)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
            signal.signal(signal.SIGXFSZ, handler)
        return 0

    ns = build_parser().parse_args(["rag", "--state", str(tmp_path), "ingest", "docs"])
    ns.rag_func = commit
    assert _run(ns) == 1
    err = capsys.readouterr().err
    assert f"kdn rag ingest: {manifest}: File too large" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary file left
