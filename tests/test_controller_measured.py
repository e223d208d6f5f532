"""The loading controller measures instead of guessing: the engine calibrates the model's
prefill speed before its first decision, bandwidth is learnt per path kind (in-process,
same-host, network) and per server, a hit's estimate pipelines transfer with decode over the
layers, and every request's predicted and measured TTFT are kept and exported."""

from __future__ import annotations

import itertools
import math
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kdn.client import Client
from kdn.delivery import (
    IN_PROCESS,
    NETWORK,
    PATH_PRIORS_B_S,
    RECOMPUTE,
    SAME_HOST,
    LoadingController,
)
from kdn.engine import EngineConfig, KDNEngine
from kdn.engine.config import Timings
from kdn.engine.measure import GROW_X, observe_request, time_prefill
from kdn.server import ServerConfig, ServerThread


class _Tok:
    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def _model(hidden: int = 256, layers: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024, rope_theta=10000.0)
    cfg._attn_implementation = "sdpa"
    return LlamaForCausalLM(cfg).eval()


def _ids(n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return [int(x) for x in torch.randint(1, 256, (n,), generator=g)]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[Client]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as st, Client(st.address) as c:
        yield c


# -- prefill calibration ----------------------------------------------------------------------


class _Clock:
    """A fake ``time.perf_counter`` that a forward advances by 1 ms a token: prefill times as
    exact as the controller's arithmetic (what is tested is what it does with a measurement,
    not how fast this host runs a model)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def forward_hook(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.now += 1e-3 * ids.shape[-1]


def test_a_calibrated_controller_predicts_a_prefill_it_then_measures(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = _Clock()
    model = _model()
    model.register_forward_pre_hook(clock.forward_hook, with_kwargs=True)
    monkeypatch.setattr("kdn.engine.engine.time.perf_counter", clock)
    engine = KDNEngine(model, _Tok(), client, EngineConfig(
        chunk_tokens=64, store_back=False, calibration_tokens=256))
    assert engine.controller.calibrated_tokens == 0  # lazily, before the first decision
    assert engine.calibrate() == pytest.approx(0.256)  # 256 tokens at the fake 1 ms a token
    assert engine.controller.calibrated_tokens == 256
    assert engine.controller.prefill_tok_s == pytest.approx(1000.0)
    prompt = _ids(240)
    predicted = engine.controller.prefill_seconds(len(prompt))
    measured = engine.generate(prompt, max_new_tokens=1, force=RECOMPUTE).timings
    assert predicted == pytest.approx(0.240)
    assert measured.first_token_compute_s == pytest.approx(predicted, rel=0.2)


def test_calibration_times_one_tokens_forward_after_its_prefill(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit's suffix (often one token) runs after the whole loaded context and costs at least
    a forward's fixed part (the weights read once), which a prefill's seconds per token leave
    out: on a CPU ~60 ms of a 0.12 s hit. The calibration times it after its prefill."""
    clock = _Clock()
    model = _model()

    def forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:  # 50 ms a forward, then 0.1 ms a token
            clock.now += 0.05 + 1e-4 * ids.shape[-1]

    model.register_forward_pre_hook(forward, with_kwargs=True)
    monkeypatch.setattr("kdn.engine.engine.time.perf_counter", clock)
    engine = KDNEngine(model, _Tok(), client, EngineConfig(
        chunk_tokens=64, store_back=False, calibration_tokens=256))
    assert engine.calibrate() == pytest.approx(0.0756)
    c = engine.controller
    assert c.prefills.step_s == pytest.approx(0.0501)
    assert c.prefill_seconds(1) == pytest.approx(0.0756 / 256)  # a prefill's share of a token
    assert c.suffix_seconds(1) == pytest.approx(0.0501)  # what one token after a context costs
    assert c.suffix_seconds(4096) == pytest.approx(0.0756 * 16)  # a long one: its prefill
    assert c.suffix_seconds(0) == 0.0


def test_a_gpus_calibration_doubles_its_prefill_while_it_stays_short(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A GPU's speed per token grows with the length (its cores fill up): its calibration
    also times 2x, 4x... the length while a prefill takes under ``grow_s``, up to ``GROW_X``
    times it and the model's context, so that a long prompt is predicted from a long class."""
    clock = _Clock()
    model = _model(hidden=64, layers=2)  # its context: 1024 positions

    def forward(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:  # 1 ms a forward, then 0.1 ms a token
            clock.now += 1e-3 + 1e-4 * ids.shape[-1]

    model.register_forward_pre_hook(forward, with_kwargs=True)
    monkeypatch.setattr("kdn.engine.measure.time.perf_counter", clock)
    got, step = time_prefill(model, 64, torch.device("cpu"), grow_s=0.05)
    assert [n for n, _ in got] == [64, 128, 256, 512]  # 512 took 52.2 ms: the last
    assert [s for _, s in got] == pytest.approx([1e-3 + 1e-4 * n for n in (64, 128, 256, 512)])
    assert step == pytest.approx(1.1e-3)
    assert [n for n, _ in time_prefill(model, 64, torch.device("cpu"))[0]] == [64]  # a CPU's
    assert [n for n, _ in time_prefill(model, 64, torch.device("cpu"), grow_s=9.0)[0]][-1] \
        == min(64 * GROW_X, model.config.max_position_embeddings - 1)
    c = LoadingController()
    for n, seconds in got:
        c.calibrate_prefill(n, seconds)
    assert c.prefill_seconds(1000) == pytest.approx(1000 * (1e-3 + 1e-4 * 512) / 512)


def test_a_hits_suffix_is_not_learnt_as_decode_time() -> None:
    """What a hit cost beyond its transfer, less its suffix's forward, is its decode: the
    forward is the same whatever the encoding, and learnt as decode it would also be added to
    the encodings not yet seen (``overhead_s_b``)."""
    kv, transfer, decode, step = 94_000_000, 0.04, 0.02, 0.06
    stream = types.SimpleNamespace(in_process=False, blocks=1, timings=types.SimpleNamespace(
        started=0.0, last_frame_received=transfer, bytes_received=kv,
        layer_ready={0: transfer + decode}))
    learnt = {}
    for calibrated in (False, True):
        c = LoadingController(prefill_tok_s=2000.0)
        if calibrated:
            c.calibrate_step(step)
        for bad in (0.0, -1.0, math.inf, math.nan, 5e-324):  # ignored, as bad observations are
            c.calibrate_step(bad)
        t = Timings(ttft_s=transfer + decode + step, computed_tokens=1)
        for _ in range(3):  # three hits: their median, whatever the prior
            observe_request(c, [stream], "raw", 2048, t, NETWORK, "s:1", kv // 2048)
        learnt[calibrated] = c.decode_speed("raw")
    assert learnt[True] == pytest.approx(kv / decode, rel=0.05)
    assert learnt[False] < kv / (decode + step) * 1.05  # the forward taken for decode time


def test_the_first_request_calibrates_unless_turned_off(client: Client) -> None:
    model = _model(hidden=64, layers=2)
    on = KDNEngine(model, _Tok(), client, EngineConfig(chunk_tokens=32, store_back=False,
                                                       calibration_tokens=64))
    on.generate(_ids(40), max_new_tokens=1)
    assert on.controller.calibrated_tokens == 64
    off = KDNEngine(model, _Tok(), client, EngineConfig(chunk_tokens=32, store_back=False,
                                                        calibrate=False))
    off.start_load(_ids(40))
    assert off.controller.calibrated_tokens == 0 and off.controller.prefill_tok_s == 500.0
    with pytest.raises(ValueError):
        EngineConfig(calibration_tokens=0)


def test_calibration_replaces_the_prior_and_prefills_refine_it() -> None:
    c = LoadingController(alpha=0.5)
    c.calibrate_prefill(256, 0.128)  # 2000 tokens/s
    assert c.prefill_tok_s == 2000 and c.prefill_seconds(1000) == pytest.approx(0.5)
    for seconds in (0.15, 0.16, 0.14):  # 256-511 tokens at 1000 tokens/s: the class follows
        c.observe_prefill(300, seconds * 2)
    assert c.prefill_seconds(300) == pytest.approx(0.3)  # the median of its last three
    assert c.prefill_seconds(0) == 0.0


# -- bandwidth per path and server --------------------------------------------------------------


def test_bandwidth_is_learnt_per_path_kind_and_per_server() -> None:
    c = LoadingController(alpha=1.0)  # the latest observation wins: easy numbers
    assert c.bandwidth(IN_PROCESS) > c.bandwidth(SAME_HOST) > c.bandwidth(NETWORK)
    assert c.bandwidth(NETWORK) == PATH_PRIORS_B_S[NETWORK]
    c.observe_transfer(10 << 30, 1.0, SAME_HOST, "a:1")
    c.observe_transfer(1 << 20, 1.0, NETWORK, "b:2")
    c.observe_transfer(1 << 30, 1.0, NETWORK, "c:3")
    assert c.bandwidth(SAME_HOST, "a:1") == 10 << 30
    assert c.bandwidth(NETWORK, "b:2") == 1 << 20  # each server its own
    assert c.bandwidth(NETWORK, "c:3") == 1 << 30
    assert c.bandwidth(NETWORK, "d:4") == 1 << 30  # a new server: what its kind showed last
    assert c.bandwidth(IN_PROCESS) == PATH_PRIORS_B_S[IN_PROCESS]  # untouched
    # the same stored bytes: fetched from the fast host, recomputed rather than crawl from b
    kv, stored = 1 << 30, {"lossless": 1 << 29}
    c.prefill_tok_s = 8192 / 0.5
    c.observe_decode("lossless", kv, 0.1)
    assert c.choose(8192, kv, stored, path=SAME_HOST, server="a:1").choice == "lossless"
    assert c.choose(8192, kv, stored, path=NETWORK, server="b:2").choice == RECOMPUTE


def test_one_given_bandwidth_is_every_links_prior_and_in_process_keeps_its_own() -> None:
    c = LoadingController(bandwidth_b_s=1e3)
    assert c.bandwidth(SAME_HOST) == c.bandwidth(NETWORK) == 1e3
    assert c.bandwidth(IN_PROCESS) == PATH_PRIORS_B_S[IN_PROCESS]


def test_the_engine_learns_the_path_its_hit_took(client: Client) -> None:
    engine = KDNEngine(_model(hidden=64, layers=2), _Tok(), client,
                       EngineConfig(chunk_tokens=32, encodings=(("raw", ""),),
                                    calibrate=False))
    prompt = _ids(100)
    first = engine.generate(prompt, max_new_tokens=1)
    assert first.store_thread is not None
    first.store_thread.join(60)
    hit = engine.generate(prompt, max_new_tokens=1, force="raw")
    assert hit.timings.reused_tokens == 96
    path = SAME_HOST if client.dataplane.attached else NETWORK
    learnt = engine.controller.bandwidths_b_s
    assert set(learnt) == {path, f"{path}@{client.address}"}, learnt


# -- pipelining -------------------------------------------------------------------------------


def test_the_pipelined_estimate_lies_between_the_max_and_the_sum() -> None:
    c = LoadingController(bandwidth_b_s=1e9, layers=32)
    c.observe_decode("lossless", 2 << 30, 1.0)  # 2 GiB/s
    stored, kv = 1 << 30, 1 << 30  # transfer ~1.07 s, decode 0.5 s
    transfer, decode = stored / 1e9, kv / c.decode_speed("lossless")
    est = c.estimate("lossless", stored, kv)
    assert max(transfer, decode) <= est < transfer + decode
    assert est == pytest.approx(max(transfer, decode) + min(transfer, decode) / 32)
    c.layers = 1  # nothing to overlap: the sum
    assert c.estimate("lossless", stored, kv) == pytest.approx(transfer + decode)


def test_the_engine_gives_the_controller_its_layer_count_where_layers_overlap(
        client: Client) -> None:
    engine = KDNEngine(_model(hidden=64, layers=3), _Tok(), client,
                       EngineConfig(calibrate=False))
    # on a CPU the receive, the decode and the model share the cores: nothing overlaps
    assert engine.controller.layers == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gpu_engine_pipelines_over_its_layers(client: Client) -> None:
    engine = KDNEngine(_model(hidden=64, layers=3).cuda(), _Tok(), client,
                       EngineConfig(calibrate=False))
    assert engine.controller.layers == 3


def test_a_hit_is_read_back_through_the_pipelined_model() -> None:
    """The decode time a hit shows is the one the estimate needs to reproduce it: all of
    what came after the last byte where decode-bound (plus what overlapped the transfer),
    ``layers`` times the tail where transfer-bound."""
    kv, stored = 1 << 30, 1 << 28
    for transfer, decode in ((0.1, 0.3), (0.3, 0.1)):  # decode-bound, then transfer-bound
        c = LoadingController(bandwidth_b_s=stored / transfer, layers=32, alpha=1.0)
        whole = max(transfer, decode) + min(transfer, decode) / 32
        for _ in range(2):  # one hit moves the prior at most twofold
            c.observe_hit("lossless", kv, transfer, whole)
        assert c.decode_speed("lossless") == pytest.approx(kv / decode)
        assert c.estimate("lossless", stored, kv) == pytest.approx(whole)
    flat = LoadingController(layers=1)
    for _ in range(2):
        flat.observe_hit("lossless", kv, 0.1, 0.35)  # nothing overlaps: the tail is the decode
    assert flat.decode_speed("lossless") == pytest.approx(kv / 0.25)


# -- predicted vs measured TTFT -----------------------------------------------------------------


def test_the_running_ttft_error() -> None:
    c = LoadingController()
    assert c.ttft_error == 0.0
    c.observe_ttft(1.2, 1.0)
    c.observe_ttft(0.5, 1.0)
    c.observe_ttft(1.0, 0.0)  # nothing measured: not counted
    assert c.ttft_requests == 2 and c.ttft_error == pytest.approx(0.35)
    assert c.last_ttft == (0.5, 1.0)


def _sample(text: str, name: str, **labels: str) -> float:
    import re

    for line in text.splitlines():
        if line.startswith(name + "{"):
            got = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
            if all(got.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{labels}")


def test_each_request_records_predicted_and_measured_ttft(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from kdn.client import metrics
    from kdn.engine import engine as engine_module
    from kdn.engine import measure

    ticks = itertools.count()
    fake = types.SimpleNamespace(perf_counter=lambda: next(ticks) * 0.01)  # 10 ms a reading
    monkeypatch.setattr(engine_module, "time", fake)  # the request's readings
    monkeypatch.setattr(measure, "time", fake)  # the calibration's
    engine = KDNEngine(_model(hidden=64, layers=2), _Tok(), client,
                       EngineConfig(chunk_tokens=32, store_back=False, calibration_tokens=64))
    engine.calibrate()
    assert engine.controller.prefill_tok_s == pytest.approx(64 / 0.01)  # one tick per prefill
    registry = CollectorRegistry()
    assert metrics.enable(registry)
    try:
        got = engine.generate(_ids(50), max_new_tokens=1).timings
        text = generate_latest(registry).decode()
    finally:
        metrics.disable()
    assert got.decision == RECOMPUTE and got.ttft_s > 0
    # nothing stored: the lookup's two readings, then the prefill of all 50 tokens
    assert got.predicted_ttft_s == pytest.approx(got.lookup_s + 50 / (64 / 0.01))
    for kind, value in (("predicted", got.predicted_ttft_s), ("measured", got.ttft_s)):
        assert _sample(text, "kdn_client_ttft_seconds_count", decision="recompute",
                       kind=kind) == 1
        assert _sample(text, "kdn_client_ttft_seconds_sum", decision="recompute",
                       kind=kind) == pytest.approx(value)
    error = abs(got.predicted_ttft_s / got.ttft_s - 1)
    assert _sample(text, "kdn_client_ttft_error_ratio_sum", decision="recompute") == \
        pytest.approx(error)
    assert engine.ttft_error == pytest.approx(error)
    assert engine.controller.last_ttft == (got.predicted_ttft_s, got.ttft_s)


def test_a_request_whose_lookup_failed_records_its_ttft_too() -> None:
    """With the server down every request is computed whole, and slow: the TTFT histogram
    still counts each one (as ``recompute``), while the controller learns nothing from them."""
    import socket

    from prometheus_client import CollectorRegistry, generate_latest

    from kdn.client import metrics

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    registry = CollectorRegistry()
    assert metrics.enable(registry)
    try:
        with Client(f"127.0.0.1:{port}", timeout_s=2) as c:
            engine = KDNEngine(_model(hidden=64, layers=2), _Tok(), c,
                               EngineConfig(chunk_tokens=32, calibrate=False,
                                            lookup_timeout_s=0.2))
            for _ in range(2):
                assert engine.generate(_ids(100), max_new_tokens=1).timings.load_error
        text = generate_latest(registry).decode()
    finally:
        metrics.disable()
    for kind in ("predicted", "measured"):
        assert _sample(text, "kdn_client_ttft_seconds_count", decision="recompute",
                       kind=kind) == 2
    assert engine.controller.ttft_requests == 0


def test_a_clock_that_does_not_advance_leaves_the_prior_and_generates(
        client: Client, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a frozen clock (a time-freezing test tool) the calibration takes 0 s: its speed is
    not learnt, the engine counts as calibrated and every request still generates (the log
    line of the calibration divided by that 0)."""
    from kdn.engine import engine as engine_module
    from kdn.engine import measure

    frozen = types.SimpleNamespace(perf_counter=lambda: 100.0)
    monkeypatch.setattr(engine_module, "time", frozen)
    monkeypatch.setattr(measure, "time", frozen)
    engine = KDNEngine(_model(hidden=64, layers=2), _Tok(), client,
                       EngineConfig(chunk_tokens=32, store_back=False, calibration_tokens=64))
    prior = engine.controller.prefill_tok_s
    for _ in range(2):
        assert len(engine.generate(_ids(40), max_new_tokens=2).token_ids) == 2
    assert engine.controller.prefill_tok_s == prior and engine.controller.calibrated_tokens == 0
