"""Does a kdn hit beat prefill on the device the engine runs on? Real model shapes, one run.

    python -m bench.gpu [--quick] [--out bench/results/gpu_h100.json]

Results are kept one file per machine (``gpu_h100.json``, ``gpu_h200.json``, ``gpu_cpu.json``);
``--merge`` joins a machine's runs of one dtype into its file.

Models of the real shapes with random weights (no weights travel; timing does not depend on
them): Llama-3-8B (32 layers, 8 KV heads x 128, GQA) and SmolLM2-135M, fp16 with sdpa
attention on a GPU (fp32 on a CPU). For each model and context length, measured in this run:

- ``prefill``: the model's full prefill of the context (best of 3), the baseline;
- every timing below is the best of 5 (2 with --quick), or of 2 where they take more than
  ``SLOW_S`` seconds together, except a hit's ``ttft_s``: the median of its hits (what a user
  sees; ``ttft_best_s`` is the best of them; rows before 2026-11-29 give the best);
- per encoding (``raw``, ``lossless``, ``int8``, ``kdn-default``) and path (``shm``: a client on
  the server's host, the default; ``inproc``: the same with an in-process tier, which the
  store fills, so loads are hits there, loaded as one joined stream; ``inproc-blocks``: the
  same hits, one stream per block joined per layer (``EngineConfig.join_in_process=False``);
  ``grpc-1``: a remote client, gRPC only; ``tcp``: a remote client on the server's network
  data path; and ``default``: an engine made with ``EngineConfig()``, storing what its device
  and path resolve to, its controller deciding, the choices in ``decisions``): ``ttft_s`` of a hit
  through ``KDNEngine`` (every block of the context stored, one token left to compute) and
  ``load_s``, the time until every layer of the context is on the model's device
  (``start_load`` + ``wait_for_layer`` of every layer, synchronised), and the host time of its
  two steps before the device is waited for (``host_start_load_s``, ``host_layers_s``: where
  they add up to ``load_s``, the host is the bound, not the copy), and ``host_phases_s``, the
  host seconds of each step of a whole-entry GPU decode and its landing within them
  (``kdn.codec.gpu_source.SECONDS``: ``land.bodies``, ``kdn.tables``, ``kdn.fill`` ...);
- the limits each row is bound by: pinned host->device copy and device->device copy (GPU), or
  memcpy (CPU): ``load_gb_s`` next to ``limit_gb_s`` gives ``ratio_to_limit``.

``ratio_vs_prefill`` = hit TTFT / full-prefill time of the same context, same run. The kdn
server runs as its own process (``python -m kdn serve``, RAM tier) on this host; on a GPU host
its read arena is 8 GiB (the default is 512 MiB), so that the longest context's blocks stay
leased there between reads (the JSON's ``server`` says what it ran with).
``--quick`` (what CI smoke-tests on CPU) runs SmolLM2's shape at 256 tokens over ``shm`` and
``inproc``.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    arg_parser,
    figure,
    machine,
    number_list,
    print_table,
    save_figure,
    write_json,
)
from bench.common import (
    kdn_server as common_kdn_server,
)
from bench.gpu_costs import decode_counts, kernel_seconds, phases, profile, sync
from kdn.client import Client
from kdn.codec import gpu_source
from kdn.delivery import encoding_name
from kdn.engine import EngineConfig, KDNEngine

SHAPES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                      num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      max_position_embeddings=131072, rope_theta=500000.0),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         max_position_embeddings=16384, rope_theta=100000.0,
                         tie_word_embeddings=True),
}
"""Models of real shapes, random weights (timing only). SmolLM2's context is 8,192 positions;
its shape here takes 16,384, since an 8k row's prompt is 8,193 tokens (the stored 8,192 and
one computed), which ``KDNEngine.generate`` refuses past a model's context."""
ENCODINGS = {encoding_name(m, lv): (m, lv)  # "kdn-default" -> ("kdn", "default")
             for m, lv in (("raw", ""), ("lossless", ""), ("int8", ""), ("kdn", "default"))}


class _Ids:
    """A tokenizer stand-in: prompts are token ids; decoded text is not needed here."""

    eos_token_id = None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return ""


def model_dtype(device: torch.device, name: str = "") -> torch.dtype:
    """``name`` (float16, bfloat16, float32), else fp16 on a GPU and fp32 on a CPU."""
    if name:
        return getattr(torch, name)  # type: ignore[no-any-return]
    return torch.float16 if device.type == "cuda" else torch.float32


def build(shape: str, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(**SHAPES[shape])
    cfg._attn_implementation = "sdpa"
    dtype = dtype or model_dtype(device)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


SLOW_S = 8.0
"""A case's repeats stop after this many seconds once two are done (a slow encoding's load
takes seconds each: the best of two says as much as the best of five)."""


def best_s(fn: Any, device: torch.device, runs: int) -> float:
    best, spent = float("inf"), 0.0
    for n in range(runs):
        if n >= 2 and spent > SLOW_S:
            break
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
        spent += time.perf_counter() - t0
    return best


def limits(device: torch.device, nbytes: int = 256 << 20) -> dict[str, float]:
    """Copy rates this machine can reach: pinned H2D and D2D on a GPU, memcpy on a CPU."""
    if device.type != "cuda":
        src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        dst = np.empty_like(src)
        return {"memcpy_gb_s": nbytes / best_s(lambda: np.copyto(dst, src), device, 5) / 1e9}
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dev2 = torch.empty_like(dev)
    return {"h2d_pinned_gb_s": nbytes / best_s(lambda: dev.copy_(host, non_blocking=True),
                                                device, 5) / 1e9,
            "d2d_gb_s": nbytes / best_s(lambda: dev2.copy_(dev), device, 5) / 1e9}


@contextmanager
def kdn_server(tmp: Path, ram: str, arena: str) -> Iterator[str]:
    with common_kdn_server(tmp / "data", "--ram-bytes", ram, "--shm-arena-bytes", arena,
                           "--max-message-bytes", str(512 << 20),
                           "--max-entry-bytes", str(8 << 30), wait_s=120) as address:
        yield address


def _ids(shape: str, tokens: int) -> list[int]:
    g = torch.Generator().manual_seed(tokens)
    return [int(x) for x in torch.randint(1, SHAPES[shape]["vocab_size"], (tokens + 1,),
                                          generator=g)]


DEFAULT = "default"
"""The encoding column of the rows of an engine made with ``EngineConfig()``'s encodings (what
the device and path resolve to) and a fresh controller, never forced: what a user who tunes
nothing gets."""


def _engine(model: Any, shape: str, tokens: int, enc: str, client: Client,
            join: bool = True, path: str = "") -> KDNEngine:
    """An engine storing ``enc`` only (``DEFAULT``: what its device and path resolve to); the
    namespace is per (shape, tokens, encoding), so a later path finds the blocks an earlier
    one stored (``DEFAULT`` ones are per path: what they resolve to may differ). ``join``:
    in-process hits load as one joined stream (``EngineConfig.join_in_process``)."""
    if enc == DEFAULT:
        return KDNEngine(model, _Ids(), client, EngineConfig(
            namespace=f"{shape}-{tokens}-{enc}-{path}", join_in_process=join))
    return KDNEngine(model, _Ids(), client, EngineConfig(namespace=f"{shape}-{tokens}-{enc}",
                                                         encodings=(ENCODINGS[enc],),
                                                         join_in_process=join))


def _stored(engine: KDNEngine, ids: list[int]) -> None:
    """Every block of ``ids`` stored (a first generate computes, then stores them)."""
    first = engine.generate(ids, max_new_tokens=1)
    if first.store_thread is not None:
        first.store_thread.join()


def measure(model: Any, shape: str, tokens: int, path: str, enc: str, client: Client,
            device: torch.device, prefill_s: float, limit: float, runs: int) -> dict[str, Any]:
    """One hit row: TTFT through ``KDNEngine`` and the time to have every layer on the device."""
    ids = _ids(shape, tokens)
    engine = _engine(model, shape, tokens, enc, client, join=path != "inproc-blocks",
                     path=path)
    _stored(engine, ids)
    kv_bytes = tokens * engine.layout.bytes_per_token
    force = None if enc == DEFAULT else enc  # the defaults' rows: the controller decides

    host: dict[str, float] = {}
    steps: dict[str, float] = {}

    def load() -> None:
        before = dict(gpu_source.SECONDS)
        t0 = time.perf_counter()
        got = engine.start_load(ids, force=force)
        t1 = time.perf_counter()
        assert got == tokens or force is None, f"{enc}: {got} of {tokens} tokens stored"
        for i in range(engine.layout.num_layers if got else 0):  # (recomputing: none)
            engine.wait_for_layer(i)
        t2 = time.perf_counter()
        engine.finish()
        if t2 - t0 < host.get("start_s", 0.0) + host.get("layers_s", 0.0) or not host:
            host.update(start_s=t1 - t0, layers_s=t2 - t1)
            steps.clear()
            steps.update(phases(before))

    load_s = best_s(load, device, runs)
    ttfts: list[float] = []
    decisions: list[str] = []
    for n in range(runs):
        if n >= 2 and sum(ttfts) > SLOW_S:
            break
        hit = engine.generate(ids, max_new_tokens=1, force=force)
        assert hit.timings.reused_tokens == tokens or force is None, enc
        ttfts.append(hit.timings.ttft_s)
        decisions.append(hit.timings.decision)
    ttft = float(np.median(ttfts))  # what a user sees; the best of them beside it
    print(f"  {shape} {tokens} {path} {enc}: ttft {ttft * 1e3:.1f} ms "
          f"({ttft / prefill_s:.3f}x prefill), load {kv_bytes / load_s / 1e9:.2f} GB/s "
          f"(host: start_load {host['start_s'] * 1e3:.1f} ms, layers "
          f"{host['layers_s'] * 1e3:.1f} ms" + "".join(
              f"; {k} {v * 1e3:.1f}" for k, v in steps.items()) + ")", flush=True)
    return {"model": shape, "tokens": tokens, "path": path, "encoding": enc,
            "ttft_s": ttft, "ttft_best_s": min(ttfts), "prefill_s": prefill_s,
            "ratio_vs_prefill": ttft / prefill_s,
            "load_s": load_s, "load_gb_s": kv_bytes / load_s / 1e9,
            "host_start_load_s": host["start_s"], "host_layers_s": host["layers_s"],
            "host_phases_s": steps, "limit_gb_s": limit,
            "ratio_to_limit": kv_bytes / load_s / 1e9 / limit,
            "kv_bytes": kv_bytes, "chunk_tokens": engine.config.chunk_tokens,
            "decision": decisions[0], "decisions": decisions,
            "stored_encodings": [encoding_name(m, lv) for m, lv in engine.encodings]}


def measure_decode(model: Any, shape: str, tokens: int, enc: str, client: Client,
                   device: torch.device, limit: float, runs: int) -> dict[str, Any]:
    """A ``decode`` row: the stored blocks of the context, already in host memory, decoded
    into tensors on ``device`` (``codec.decode``, one entry after another, synchronised);
    ``decode_gb_s`` counts fp16-equivalent output bytes (the KV's own bytes). On a GPU,
    ``together_s``: all entries in one whole-entry decode, and ``together_phases_s`` the host
    seconds of its steps (``kdn.codec.gpu_source.SECONDS``)."""
    from kdn import codec, keys

    ids = _ids(shape, tokens)
    engine = _engine(model, shape, tokens, enc, client)
    _stored(engine, ids)
    blobs = []
    for k in engine._chain(ids):  # noqa: SLF001
        got = client.fetch(keys.variant_key(k, enc), namespace=engine.config.namespace)
        assert got is not None, f"{enc}: a block is missing"
        blobs.append(bytes(got.container) if got.container is not None
                     else got.parts.to_bytes())
    kv_bytes = tokens * engine.layout.bytes_per_token
    decode_s = best_s(lambda: [codec.decode(b, device=device) for b in blobs], device, runs)
    gb_s = kv_bytes / decode_s / 1e9
    together_s = best_s(lambda: _decode_together(blobs, device), device, runs) \
        if device.type == "cuda" else None
    together_phases: dict[str, float] = {}
    arena_s, arena_phases = None, {}
    if together_s is not None:
        together_phases = _host_steps(lambda: _decode_together(blobs, device), device)
        pinned, views = in_pinned(blobs)  # as a hit from the read arena finds them

        def from_arena() -> None:
            _decode_together(views, device, pinned=True, checked=True)

        arena_s = best_s(from_arena, device, runs)
        arena_phases = _host_steps(from_arena, device)
        del pinned, views
    counts = decode_counts(blobs, device)
    if PROFILE_DECODE:
        profile(f"{enc}: codec.decode of each entry",
                 lambda: [codec_decode(b, device) for b in blobs], device)
        if device.type == "cuda":
            profile(f"{enc}: all entries in one decode",
                     lambda: _decode_together(blobs, device), device)
    kernel_s = kernel_seconds(lambda: [codec.decode(b, device=device) for b in blobs], device)
    kernel_gb_s = kv_bytes / kernel_s / 1e9 if kernel_s else None
    print(f"  {shape} {tokens} decode {enc} on {device.type}: {decode_s * 1e3:.1f} ms, "
          f"{gb_s:.2f} GB/s (kernels {kernel_gb_s or 0:.1f} GB/s; per entry "
          f"{counts['launches']:.1f} launches, {counts['host_syncs']:.1f} syncs; all "
          f"{len(blobs)} entries in one decode: "
          f"{kv_bytes / together_s / 1e9 if together_s else 0:.1f} GB/s, from page-locked "
          f"checked entries as in the read arena: "
          f"{kv_bytes / arena_s / 1e9 if arena_s else 0:.1f} GB/s)", flush=True)
    return {"model": shape, "tokens": tokens, "path": "decode", "encoding": enc,
            "decode_s": decode_s, "decode_gb_s": gb_s, "stored_bytes": sum(map(len, blobs)),
            "kernel_s": kernel_s, "kernel_gb_s": kernel_gb_s, **counts,
            "together_s": together_s,
            "together_gb_s": kv_bytes / together_s / 1e9 if together_s else None,
            "together_phases_s": together_phases,
            "arena_s": arena_s, "arena_gb_s": kv_bytes / arena_s / 1e9 if arena_s else None,
            "arena_phases_s": arena_phases,
            "entries": len(blobs),
            "limit_gb_s": limit, "ratio_to_limit": gb_s / limit, "kv_bytes": kv_bytes,
            "chunk_tokens": engine.config.chunk_tokens}


def _host_steps(decode: Any, device: torch.device) -> dict[str, float]:
    """Where the host's time goes in one more ``decode()`` (``gpu_source.SECONDS``)."""
    before = dict(gpu_source.SECONDS)
    decode()
    sync(device)
    return phases(before)


def in_pinned(blobs: list[bytes]) -> tuple[torch.Tensor, list[memoryview]]:
    """``blobs`` copied one after another into one page-locked host buffer, each viewed as an
    array of its own over it (as the read arena hands out a context's entries), and the
    buffer (keep it while the views are used)."""
    host = torch.empty(max(sum(map(len, blobs)), 1), dtype=torch.uint8,
                       pin_memory=torch.cuda.is_available())
    whole = host.numpy()
    views, at = [], 0
    for b in blobs:
        whole[at : at + len(b)] = np.frombuffer(b, np.uint8)
        views.append(memoryview(whole[at : at + len(b)]))
        at += len(b)
    return host, views


PROFILE_DECODE = False
"""``--profile-decode``: print where the host's time goes in the decode rows (cProfile)."""


def _decode_together(blobs: list[bytes] | list[memoryview], device: torch.device,
                     pinned: bool = False, checked: bool = False) -> None:
    """Every entry's layers decoded in one whole-entry decode (what an engine's hit on the
    blocks of one context does: ``kdn.client.landing.decoded_together``; ``pinned``: the
    entries lie in page-locked memory, as the read arena's do; ``checked``: their sums were
    checked already, as the server checks what its arena holds, else they are computed
    beside the decode, as for any bytes nobody checked)."""
    from kdn.codec import StreamDecoder, parse_container
    from kdn.codec.api import decoded_beside, entry_bodies
    from kdn.codec.format import sums_checked_later

    bodies, addresses, specs, waits, dec = [], [], [], [], None
    for b in blobs:
        c = parse_container(b, verify=False)
        dec = StreamDecoder(c.header, device)
        got = entry_bodies(c.header, c.frames, hashed=checked)
        bodies += got.bodies
        addresses += got.addresses
        specs += got.specs
        if not checked:
            waits.append(sums_checked_later(c.header, c.frames))
    assert dec is not None
    done = decoded_beside(waits, lambda: dec.mode.decode_layers(
        bodies, specs, dec.level, device, pinned=pinned, addresses=addresses))
    if done is None:  # an encoding without a whole-entry decoder
        for b in blobs:
            codec_decode(b, device)
    else:
        done.check()


def codec_decode(blob: bytes, device: torch.device) -> None:
    from kdn import codec

    codec.decode(blob, device=device)


# (tokens, path, encoding) per model, in the order they run: what the targets need first, so a
# run cut short by --budget-s still has them. ``decode`` rows decode an encoding's stored
# blocks on the device (kdn.codec.gpu for the entropy-coded modes).
GPU_PLAN: dict[str, list[tuple[int, str, str]]] = {
    "llama3-8b": [
        (8192, "shm", "raw"), (8192, "inproc", "raw"), (8192, "inproc-blocks", "raw"),
        (32768, "shm", "raw"), (32768, "inproc", "raw"), (32768, "inproc-blocks", "raw"),
        (2048, "shm", "raw"), (2048, "inproc", "raw"), (2048, "inproc-blocks", "raw"),
        (8192, "shm", "kdn-default"), (8192, "decode", "kdn-default"),
        (8192, "shm", "int8"), (8192, "decode", "int8"), (8192, "grpc-1", "raw"),
        (8192, "tcp", "raw"),
        (8192, "shm", "lossless"), (8192, "grpc-1", "kdn-default"),
        (2048, "shm", "kdn-default"), (2048, "grpc-1", "raw"),
        (2048, "shm", "int8"), (2048, "shm", "lossless"), (8192, "decode", "lossless"),
        (32768, "shm", "kdn-default"), (32768, "grpc-1", "raw"),
        (8192, "shm", DEFAULT), (8192, "inproc", DEFAULT), (32768, "shm", DEFAULT),
        (32768, "inproc", DEFAULT)],
    "smollm2-135m": [
        (2048, "shm", "raw"), (2048, "inproc", "raw"), (8192, "shm", "raw"),
        (8192, "inproc", "raw"), (2048, "shm", "kdn-default"), (8192, "shm", "kdn-default")],
}
RESERVE_S = 45.0  # of --budget-s kept for the models after the first


def run(plan: dict[str, list[tuple[int, str, str]]], runs: int, out: Path,
        budget_s: float = 0.0, dtype_name: str = "") -> dict[str, Any]:
    """Every case of ``plan``; with ``budget_s``, cases not started by then are skipped (the
    JSON is rewritten after each row, so a run stopped from outside keeps what it measured)."""
    t_start = time.perf_counter()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    lim = limits(device)
    limit = lim.get("h2d_pinned_gb_s", lim.get("memcpy_gb_s", 0.0))
    dec_limit = lim.get("d2d_gb_s", limit)
    rows: list[dict[str, Any]] = []
    skipped: list[str] = []
    ram = "64GiB" if device.type == "cuda" else "6GiB"
    # the read arena holds the hot working set on a GPU host (the longest context, 4 GiB, and
    # more): same-host hits are then leases of its pages, copied to the GPU where they lie
    arena = "8GiB" if device.type == "cuda" else "512MiB"
    local = (12 << 30) if device.type == "cuda" else (2 << 30)  # the in-process tier's bytes
    info = machine()

    def save() -> None:
        write_json(out, "gpu", rows, device=info["cuda"] or f"cpu ({info['cpus']} cores)",
                   torch=torch.__version__, limits=lim, attention="sdpa",
                   dtype=str(model_dtype(device, dtype_name)).removeprefix("torch."),
                   torch_threads=torch.get_num_threads(), skipped=skipped,
                   server={"ram_bytes": ram, "shm_arena_bytes": arena},
                   wall_s=time.perf_counter() - t_start)

    clients: dict[str, Client] = {}
    with tempfile.TemporaryDirectory() as tmp, kdn_server(Path(tmp), ram, arena) as address:
        try:
            for n, (shape, cases) in enumerate(plan.items()):
                model = build(shape, device, model_dtype(device, dtype_name))
                prefills: dict[int, float] = {}
                for tokens, path, enc in cases:
                    left = budget_s - (time.perf_counter() - t_start)
                    if budget_s and left < (RESERVE_S if n + 1 < len(plan) else 0.0):
                        skipped.append(f"{shape} {tokens} {path} {enc}")
                        continue
                    if tokens not in prefills:
                        ids = torch.randint(1, SHAPES[shape]["vocab_size"], (1, tokens),
                                            device=device)
                        with torch.inference_mode():
                            prefills[tokens] = best_s(
                                lambda m=model, x=ids: m(x, use_cache=True, logits_to_keep=1),
                                device, 3)
                        print(f"{shape}: prefill of {tokens} tokens "
                              f"{prefills[tokens] * 1e3:.1f} ms", flush=True)
                    key = {"decode": "shm", "inproc-blocks": "inproc"}.get(path, path)
                    if key not in clients:
                        clients[key] = Client(address,  # remote: gRPC only, or the data path
                                              shm_bytes=0 if key in ("grpc-1", "tcp") else None,
                                              data_path=key != "grpc-1",
                                              local_bytes=local if key == "inproc" else 0,
                                              max_message_bytes=512 << 20)
                    if path == "decode":
                        rows.append(measure_decode(model, shape, tokens, enc, clients[key],
                                                   device, dec_limit, runs))
                    else:
                        rows.append(measure(model, shape, tokens, path, enc, clients[key],
                                            device, prefills[tokens], limit, runs))
                    save()
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        finally:
            for c in clients.values():
                c.close()
    hits = [r for r in rows if r["path"] != "decode"]
    decodes = [r for r in rows if r["path"] == "decode"]
    if hits:
        print_table(hits, ["model", "tokens", "path", "encoding", "ttft_s", "prefill_s",
                           "ratio_vs_prefill", "load_gb_s", "ratio_to_limit"])
    if decodes:
        print_table(decodes, ["model", "tokens", "encoding", "decode_s", "decode_gb_s",
                              "ratio_to_limit"])
    if skipped:
        print(f"skipped (past --budget-s {budget_s:.0f}): {', '.join(skipped)}")
    save()
    plot(hits, out.with_suffix(".png"))
    return {"rows": rows, "limits": lim}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    groups = sorted({(r["model"], r["tokens"]) for r in rows})
    series = sorted({(r["path"], r["encoding"]) for r in rows})
    fig, ax = figure(10, 4.5)
    width = 0.8 / max(1, len(series))
    for j, (p, enc) in enumerate(series):
        ys = [next((r["ratio_vs_prefill"] for r in rows if (r["model"], r["tokens"]) == g
                    and r["path"] == p and r["encoding"] == enc), 0) for g in groups]
        ax.bar([i + j * width for i in range(len(groups))], ys, width, label=f"{p} {enc}")
    ax.axhline(1.0, color="k", linestyle="--", label="full prefill")
    ax.set_xticks([i + 0.4 for i in range(len(groups))], [f"{m}\n{t} tok" for m, t in groups])
    ax.set_ylabel("hit TTFT / prefill")
    ax.set_yscale("log")
    ax.set_title("kdn hit vs full prefill (lower is better)")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, path)


def merge(sources: list[str], out: Path) -> dict[str, Any]:
    """One report from several runs on one kind of device and dtype (``FILE[:LABEL]`` each,
    oldest first; other devices or dtypes are refused): per (model, tokens, path, encoding),
    the row of the latest run that has it, naming its run by when it ran; every run's limits,
    time, dtype and torch are kept under ``runs``."""
    runs: dict[str, Any] = {}
    rows: dict[tuple[Any, ...], dict[str, Any]] = {}
    docs = []
    for src in sources:
        name, _, label = src.partition(":")
        doc = json.loads(Path(name).read_text())
        docs.append(doc)
        tag = doc["when"]  # a run is named by when it ran
        # (the runs of older merged reports hold no "when": their keys say it)
        named = {old: run.get("when", old) for old, run in doc.get("runs", {}).items()}
        if named:  # a merged report: its runs and each row's own run kept
            runs.update({named[old]: {"dtype": doc["dtype"], "torch": doc["torch"], **run,
                                      "when": named[old]}
                         for old, run in doc["runs"].items()})
        else:
            runs[tag] = {"when": doc["when"], "limits": doc["limits"], "label": label,
                         "dtype": doc["dtype"], "torch": doc["torch"],
                         "server": doc.get("server"), "skipped": doc.get("skipped", [])}
        for r in doc["rows"]:
            section = "decode on the device" if r["path"] == "decode" else "hits"
            rows[(r["model"], r["tokens"], r["path"], r["encoding"])] = {
                "section": section, **r, "run": named.get(r.get("run", ""), tag)}
    devices = {d["device"] for d in docs}
    if len(devices) != 1:
        raise SystemExit(f"runs from different devices can not be merged: {sorted(devices)}")
    dtypes = {r["dtype"] for r in runs.values()}
    if len(dtypes) != 1:
        raise SystemExit(f"runs of different dtypes can not be merged: {sorted(dtypes)}")
    merged = sorted(rows.values(), key=lambda r: (r["model"], r["tokens"], r["path"] == "decode",
                                                  r["path"], r["encoding"]))
    last = docs[-1]
    write_json(out, "gpu", merged, machine=last["machine"], when=last["when"],
               device=last["device"], torch=last["torch"],
               limits=last["limits"], attention=last["attention"], dtype=last["dtype"],
               server=last.get("server"), runs=runs)
    plot([r for r in merged if r["path"] != "decode"], out.with_suffix(".png"))
    return {"rows": merged, "runs": runs}


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "gpu", "SmolLM2 shape, 256 tokens, shm and inproc paths")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="skip the cases not started after this many seconds (0: run all)")
    ap.add_argument("--encodings", default="",
                    help="comma-separated encodings to run (default: every one in the plan)")
    ap.add_argument("--paths", default="",
                    help="comma-separated paths to run (shm, inproc, inproc-blocks, grpc-1, "
                         "tcp, decode; default all)")
    ap.add_argument("--dtype", default="", choices=["", "float16", "bfloat16", "float32"],
                    help="the models' dtype (default fp16 on a GPU, fp32 on a CPU; `raw` "
                         "entries of 2-byte KV are viewed in place on a CPU too)")
    ap.add_argument("--merge", nargs="+", metavar="FILE[:LABEL]",
                    help="write --out from these runs' JSON instead of measuring (oldest first)")
    ap.add_argument("--tokens", default=[], type=number_list(int),
                    help="comma-separated context lengths to run (default: every one)")
    ap.add_argument("--profile-decode", action="store_true",
                    help="print where the host's time goes in the decode rows (cProfile)")
    ns = ap.parse_args(argv)
    global PROFILE_DECODE
    PROFILE_DECODE = ns.profile_decode
    if ns.merge:
        if missing := [m for m in ns.merge if not Path(m.partition(":")[0]).is_file()]:
            ap.error(f"--merge: no such file: {', '.join(missing)}")
        merge(ns.merge, ns.out)
        return
    if ns.quick:
        plan: dict[str, list[tuple[int, str, str]]] = {"smollm2-135m": [
            (256, p, e) for p in ("shm", "inproc") for e in [*ENCODINGS, DEFAULT]]
            + [(256, "decode", "kdn-default")]}
        runs = 2
    elif torch.cuda.is_available():
        plan, runs = GPU_PLAN, 5
    else:
        plan, runs = {"smollm2-135m": [(2048, p, e) for p in ("shm", "inproc", "inproc-blocks",
                                                              "grpc-1", "tcp")
                                       for e in [*ENCODINGS, DEFAULT]]}, 5
    encs = set(filter(None, ns.encodings.split(",")))
    paths = set(filter(None, ns.paths.split(",")))
    lengths = set(ns.tokens)
    for what, asked, col in (("--encodings", encs, 2), ("--paths", paths, 1),
                             ("--tokens", lengths, 0)):
        has = {str(c[col]) for cs in plan.values() for c in cs}
        if unknown := sorted(set(map(str, asked)) - has):
            ap.error(f"{what}: this run's plan has no {', '.join(unknown)} (it has "
                     f"{', '.join(sorted(has))})")
    plan = {m: [c for c in cases if (not encs or c[2] in encs) and (not paths or c[1] in paths)
                and (not lengths or c[0] in lengths)]
            for m, cases in plan.items()}
    plan = {m: cases for m, cases in plan.items() if cases}
    if not plan:
        ap.error("no case of this run's plan has all of --encodings, --paths and --tokens")
    run(plan, runs, ns.out, ns.budget_s, ns.dtype)


if __name__ == "__main__":
    main()
