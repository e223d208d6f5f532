"""The transformers engine on the real SmolLM2-135M: prefix reuse through a real server gives
the same greedy output as a full prefill, and computes only what is missing."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kdn.client import Client
from kdn.delivery import LoadingController
from kdn.engine import EngineConfig, KDNEngine
from kdn.server import ServerConfig, ServerThread

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def smol() -> tuple:
    from kdn.model.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture
def engine(smol: tuple, tmp_path: Path) -> Iterator[KDNEngine]:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=512 << 20)
    with ServerThread(cfg) as st, Client(st.address) as c:
        yield KDNEngine(smol[0], smol[1], c, EngineConfig(chunk_tokens=64))


def _prompt(tokenizer: object, n: int, offset: int = 0) -> list[int]:
    from kdn.model.data import english_token_ids

    return [int(t) for t in english_token_ids(n, tokenizer, offset_paragraphs=offset)]


def test_lossless_reuse_matches_full_prefill(engine: KDNEngine) -> None:
    ids = _prompt(engine.tokenizer, 300)
    full = engine.generate(ids, max_new_tokens=12)
    assert full.timings.decision == "recompute" and full.timings.reused_tokens == 0
    assert full.store_thread is not None
    full.store_thread.join(60)
    hit = engine.generate(ids, max_new_tokens=12)
    assert hit.timings.decision == "lossless"
    assert hit.timings.reused_tokens == 256 and hit.timings.computed_tokens == 44
    assert hit.token_ids == full.token_ids
    forced = engine.generate(ids, max_new_tokens=12, force="recompute")
    assert forced.timings.reused_tokens == 0 and forced.token_ids == full.token_ids
    assert engine.controller.counts["recompute"] >= 1 and engine.controller.counts["lossless"] >= 1


def test_half_prefix_hit(engine: KDNEngine) -> None:
    a = _prompt(engine.tokenizer, 260)
    first = engine.generate(a, max_new_tokens=2)
    assert first.store_thread is not None
    first.store_thread.join(60)
    b = a[:140] + _prompt(engine.tokenizer, 120, offset=50)
    got = engine.generate(b, max_new_tokens=8)
    assert got.timings.reused_tokens == 128  # blocks 0 and 1 match; block 2 differs
    assert got.store_thread is not None
    got.store_thread.join(60)
    reference = engine.generate(b, max_new_tokens=8, force="recompute")
    assert got.token_ids == reference.token_ids


def test_controller_prefers_recompute_on_a_slow_link(smol: tuple, tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0)
    with ServerThread(cfg) as st, Client(st.address) as c:
        slow = LoadingController(bandwidth_b_s=1e3, prefill_tok_s=1e4, alpha=0.0)
        eng = KDNEngine(smol[0], smol[1], c, EngineConfig(chunk_tokens=64), slow)
        ids = _prompt(eng.tokenizer, 200)
        g = eng.generate(ids, max_new_tokens=1)
        assert g.store_thread is not None
        g.store_thread.join(60)
        again = eng.generate(ids, max_new_tokens=1)
        assert again.timings.decision == "recompute" and again.timings.reused_tokens == 0
        forced = eng.generate(ids, max_new_tokens=1, force="lossless")
        assert forced.timings.reused_tokens == 192


def test_the_controller_learns_decode_speed_per_device() -> None:
    gpu = LoadingController(bandwidth_b_s=1.25e9, prefill_tok_s=3e4, device="cuda")
    cpu = LoadingController(bandwidth_b_s=1.25e9, prefill_tok_s=500, device="cpu")
    kv_bytes, stored = 1 << 30, {"raw": 1 << 30, "kdn-default": (1 << 30) // 7}
    for c in (gpu, cpu):  # the same observations of both devices reach both controllers
        c.observe_decode("kdn-default", kv_bytes, 0.02, device="cuda")  # ~50 GB/s on a GPU
        c.observe_decode("kdn-default", kv_bytes, 3.0, device="cpu")  # ~0.35 GB/s on a CPU
        c.observe_decode("raw", kv_bytes, 0.001, device="cuda")
        c.observe_decode("raw", kv_bytes, 0.001, device="cpu")
    assert gpu.decode_speed("kdn-default") > 100 * cpu.decode_speed("kdn-default")
    # over a 10 Gbit/s link the GPU host fetches the compressed bytes, the CPU host raw ones
    assert gpu.choose(8192, kv_bytes, stored).choice == "kdn-default"
    assert cpu.choose(8192, kv_bytes, stored).choice == "raw"


def test_a_fresh_gpu_controller_knows_the_gpu_decoders_and_a_cpu_one_keeps_its_prior() -> None:
    from kdn.delivery.defaults import DECODE_PRIORS_B_S

    gpu = LoadingController(bandwidth_b_s=20e9, prefill_tok_s=3e4, device="cuda")
    cpu = LoadingController(bandwidth_b_s=20e9, prefill_tok_s=3e4, device="cpu")
    assert gpu.decode_speed("kdn-default") == DECODE_PRIORS_B_S[("kdn", "cuda")]
    assert gpu.decode_speed("kdn-tiny", "cuda:1") == gpu.decode_speed("kdn-default")
    assert gpu.decode_speed("int8") == DECODE_PRIORS_B_S[("int8", "cuda")]
    assert cpu.decode_speed("kdn-default") == cpu.decode_speed("int8") == 1e9
    # 8k tokens of an 8B model (1 GiB of KV; a 0.27 s prefill) from the engine's own host:
    # before any hit, a GPU engine reads kdn-default rather than recompute
    kv_bytes, stored = 1 << 30, {"kdn-default": (1 << 30) // 6}
    assert gpu.choose(8192, kv_bytes, stored).choice == "kdn-default"
    assert cpu.choose(8192, kv_bytes, stored).choice == "recompute"
    gpu.observe_decode("kdn-default", kv_bytes, 2.0)  # once seen, what was seen counts
    assert gpu.decode_speed("kdn-default") < 1e9
