"""Defaults that pay off where the engine runs, and a controller that knows its link and its
decoders before the first decision: ``EngineConfig()`` stores what wins on the model's device
and path (``kdn.delivery.default_encodings``), a fresh engine measures a network link with two
probe entries (``kdn.client.probe``) and times the decode of the encodings it has no speed
for."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kdn.client import Client
from kdn.client.probe import SIZES, probe_key, probe_link
from kdn.delivery import (
    IN_PROCESS,
    NETWORK,
    PATH_PRIORS_B_S,
    RECOMPUTE,
    SAME_HOST,
    LoadingController,
    default_encodings,
)
from kdn.engine import EngineConfig, KDNEngine
from kdn.server import ServerConfig, ServerThread

RATE = 50_000_000  # bytes/s: the emulated link of the probe tests (0.4 Gbit/s: slow enough
# that a busy host's own costs stay small beside it)


class _Tok:
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def _model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=512 << 20)
    with ServerThread(cfg) as st:
        yield st


@pytest.fixture
def throttled(tmp_path: Path) -> Iterator[ServerThread]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=512 << 20,
                       egress_bytes_per_s=RATE)
    with ServerThread(cfg) as st:
        yield st


# -- what EngineConfig() stores ----------------------------------------------------------------


@pytest.mark.parametrize(("device", "path", "expected"), [
    ("cpu", SAME_HOST, (("lossless", ""),)),
    ("cpu", NETWORK, (("lossless", ""),)),
    ("cpu", IN_PROCESS, (("lossless", ""),)),
    ("cuda", SAME_HOST, (("raw", ""),)),
    ("cuda:1", IN_PROCESS, (("raw", ""),)),
    ("cuda", NETWORK, (("kdn", "default"), ("raw", ""))),
])
def test_the_defaults_follow_the_device_and_the_path(device: str, path: str,
                                                     expected: tuple) -> None:
    assert default_encodings(device, path) == expected


def test_a_cpu_engine_keeps_lossless_and_a_given_list_is_kept(server: ServerThread) -> None:
    with Client(server.address) as c:
        assert KDNEngine(_model(), _Tok(), c, EngineConfig()).encodings == (("lossless", ""),)
        given = (("int8", ""), ("raw", ""))
        assert KDNEngine(_model(), _Tok(), c,
                         EngineConfig(encodings=given)).encodings == given
    with pytest.raises(ValueError, match="at least one"):
        EngineConfig(encodings=())


def test_the_engine_resolves_the_defaults_for_its_device_and_path(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine asks ``default_encodings`` with its model's device type and the path its
    hits take: the client's in-process tier, the shared segment, or the network."""
    asked: list[tuple[str, str]] = []

    def spy(device: str, path: str) -> tuple[tuple[str, str], ...]:
        asked.append((device, path))
        return (("int8", ""),)

    monkeypatch.setattr("kdn.engine.engine.default_encodings", spy)
    for kwargs, path in (({}, SAME_HOST), ({"shm_bytes": 0}, NETWORK),
                         ({"local_bytes": 16 << 20}, IN_PROCESS)):
        with Client(server.address, **kwargs) as c:
            engine = KDNEngine(_model(), _Tok(), c, EngineConfig(calibrate=False))
            assert engine.encodings == (("int8", ""),)
        assert asked[-1] == ("cpu", path), kwargs


def test_a_default_engine_hits_and_stores_what_it_resolved(server: ServerThread) -> None:
    with Client(server.address) as c:
        engine = KDNEngine(_model(), _Tok(), c, EngineConfig(chunk_tokens=32))
        prompt = [(5 * i + 1) % 256 for i in range(100)]
        first = engine.generate(prompt, max_new_tokens=2)
        assert first.store_thread is not None
        first.store_thread.join(60)
        again = engine.generate(prompt, max_new_tokens=2, force="lossless")
    assert again.timings.reused_tokens == 96 and again.token_ids == first.token_ids


# -- the heap a GPU engine freezes (EngineConfig.freeze_heap) -------------------------------------


@pytest.fixture
def thawed() -> Iterator[None]:
    """A test that may freeze the process's heap gives it back to the collector after."""
    gc.unfreeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize(("freeze", "frozen"), [(True, True), (False, False), (None, False)])
def test_the_heap_is_frozen_before_the_first_request_only_where_asked_or_on_a_gpu(
        server: ServerThread, thawed: None, freeze: bool | None, frozen: bool) -> None:
    with Client(server.address) as c:
        engine = KDNEngine(_model(), _Tok(), c, EngineConfig(chunk_tokens=32,
                                                             freeze_heap=freeze))
        assert gc.get_freeze_count() == 0  # nothing before the first request
        prompt = [(3 * i + 2) % 256 for i in range(70)]
        first = engine.generate(prompt, max_new_tokens=2)
        # the model, torch and kdn: what a full collection no longer scans
        assert (gc.get_freeze_count() > 10_000) == frozen, gc.get_freeze_count()
        assert first.store_thread is not None
        first.store_thread.join(60)
        count = gc.get_freeze_count()
        again = engine.generate(prompt, max_new_tokens=2, force="lossless")
        assert gc.get_freeze_count() <= count  # once, before the first request only
    assert again.timings.reused_tokens == 64 and again.token_ids == first.token_ids


# -- the link probe ------------------------------------------------------------------------------


def test_the_probe_measures_an_emulated_link(throttled: ServerThread) -> None:
    with Client(throttled.address, shm_bytes=0) as c:  # the network data path
        assert not c.dataplane.attached
        got = probe_link(c, "probe-test")
        assert got is not None
        assert got.bytes_per_s == pytest.approx(RATE, rel=0.3)
        assert got.seconds[1] > got.seconds[0] >= 0
        # the entries stay for the next probe: stored once per server and namespace
        infos = c.lookup([probe_key(n) for n in SIZES], namespace="probe-test").infos
        assert all(i.present and i.size_bytes >= n for i, n in zip(infos, SIZES))
        again = probe_link(c, "probe-test", rounds=1)
    assert again is not None and again.bytes_per_s == pytest.approx(RATE, rel=0.3)


def test_the_probe_reads_past_the_in_process_tier(throttled: ServerThread) -> None:
    with Client(throttled.address, shm_bytes=0, local_bytes=256 << 20) as c:
        got = probe_link(c, "probe-test")
        assert got is not None and got.bytes_per_s == pytest.approx(RATE, rel=0.3)
        assert c.local is not None
        assert all(c.local.contains("probe-test", probe_key(n)) is None for n in SIZES)


def test_a_probe_that_can_not_run_leaves_the_prior(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=16 << 20)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0, timeout_s=10) as c:
        assert probe_link(c, "probe-test") is None  # 40 MiB do not fit a 16 MiB tier
    with Client("127.0.0.1:1", shm_bytes=0, timeout_s=0.5) as c:
        assert probe_link(c) is None  # nothing listens there


def test_a_fresh_engine_across_a_network_knows_its_link_and_decoders(
        throttled: ServerThread) -> None:
    with Client(throttled.address, shm_bytes=0) as c:
        engine = KDNEngine(_model(), _Tok(), c, EngineConfig(chunk_tokens=32,
                                                             calibration_tokens=64))
        ctl = engine.controller
        assert ctl.bandwidth(NETWORK, c.address) == PATH_PRIORS_B_S[NETWORK]  # lazily
        assert not ctl.knows_decode("lossless")
        engine.calibrate()
        assert ctl.bandwidth(NETWORK, c.address) == pytest.approx(RATE, rel=0.3)
        assert ctl.bandwidth(NETWORK) == pytest.approx(RATE, rel=0.3)
        assert ctl.knows_decode("lossless") and ctl.decode_speed("lossless") > 0


def test_probing_can_be_turned_off_and_a_same_host_engine_does_not_probe(
        throttled: ServerThread) -> None:
    with Client(throttled.address, shm_bytes=0) as c:
        off = KDNEngine(_model(), _Tok(), c, EngineConfig(calibration_tokens=16,
                                                          probe_link=False))
        off.calibrate()
        assert NETWORK not in off.controller.bandwidths_b_s
        assert not any(c.lookup([probe_key(n) for n in SIZES]).infos[i].present
                       for i in range(2))
    with Client(throttled.address) as c:
        assert c.dataplane.attached
        KDNEngine(_model(), _Tok(), c, EngineConfig(calibration_tokens=16)).calibrate()
        assert not any(i.present for i in c.lookup([probe_key(n) for n in SIZES]).infos)


# -- what the controller does with them ----------------------------------------------------------


def test_calibrated_speeds_replace_priors_and_hits_refine_them() -> None:
    c = LoadingController(alpha=0.5)
    c.calibrate_link(1e8, NETWORK, "a:1")
    assert c.bandwidth(NETWORK, "a:1") == c.bandwidth(NETWORK, "b:2") == 1e8
    c.observe_transfer(3 << 20, (3 << 20) / 3e8, NETWORK, "a:1")  # a hit at 3e8
    assert c.bandwidth(NETWORK, "a:1") == pytest.approx(2e8)
    assert not c.knows_decode("kdn-default")  # no prior on a CPU
    assert c.knows_decode("raw", "cuda")  # a prior on a GPU
    c.calibrate_decode("kdn-default", 1 << 30, 0.5)
    assert c.knows_decode("kdn-default") and c.decode_speed("kdn-default") == 2 << 30
    c.observe_decode("kdn-default", 1 << 30, 1.0)  # the first hit replaces the calibration
    assert c.decode_speed("kdn-default") == 1 << 30
    c.observe_decode("kdn-default", 1 << 30, 0.25)  # later ones are running means
    assert c.decode_speed("kdn-default") == pytest.approx(0.5 * (1 << 30) + 0.5 * (4 << 30))
    c.calibrate_link(0, NETWORK)  # nothing measured: nothing changes
    assert c.bandwidth(NETWORK) == pytest.approx(2e8)  # the kind followed the hit too


def test_a_slow_link_turns_the_choice_from_raw_to_the_compressed_encoding() -> None:
    """8k tokens of an 8B model on a GPU (1 GiB of KV; prefill 0.26 s): ``raw`` from a fast
    link, ``kdn-default`` (7x smaller) from a 10 Gbit/s one, and recomputing over 1 Gbit/s."""
    kv = 1 << 30
    stored = {"raw": kv, "kdn-default": kv // 7}
    for rate, best in ((12.5e9, "raw"), (1.25e9, "kdn-default"), (0.125e9, RECOMPUTE)):
        c = LoadingController(device="cuda", layers=32, prefill_tok_s=8192 / 0.26)
        c.calibrate_link(rate, NETWORK, "s:1")
        assert c.choose(8192, kv, stored, path=NETWORK, server="s:1").choice == best, rate


@pytest.mark.gpu
def test_a_default_cuda_engine_beside_its_server_stores_raw_and_hits(
        server: ServerThread) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model().to("cuda", torch.float16)
    with Client(server.address) as c:
        assert c.dataplane.attached
        engine = KDNEngine(model, _Tok(), c, EngineConfig(chunk_tokens=32))
        assert engine.encodings == (("raw", ""),)
        prompt = [(5 * i + 1) % 256 for i in range(100)]
        first = engine.generate(prompt, max_new_tokens=2)
        assert first.store_thread is not None
        first.store_thread.join(60)
        again = engine.generate(prompt, max_new_tokens=2, force="raw")
        assert gc.get_freeze_count() > 10_000  # a GPU engine froze the heap before request 1
        gc.unfreeze()
    assert again.timings.reused_tokens == 96 and again.timings.decision == "raw"
