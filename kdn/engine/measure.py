"""What a ``KDNEngine`` measures for its loading controller (``kdn.delivery.LoadingController``).

Before its first decision (``KDNEngine.calibrate``):

* ``time_prefill``: the seconds of a prefill of ``EngineConfig.calibration_tokens`` tokens on
  this machine (the model's own prefill speed instead of a prior; on a GPU, of longer ones
  too while they stay short: ``GROW_S``), and of one token's forward after the longest (the
  least a hit's suffix costs);
* ``time_decodes``: the decode of one random block in each stored encoding the controller has
  no speed for on the model's device.

After each request whose load did not fail (``KDNEngine.generate``):

* ``observe_request``: what the hit's streams took (each path's bandwidth from what crossed
  it, the hit's cost beyond its transfer), or the prefill's speed where nothing was loaded.

Times are the best of a few runs with the device synchronised around each: one-time costs and
a busy spell are not the model's speed.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import LayerStream
from kdn.delivery import IN_PROCESS, LoadingController, encoding_name
from kdn.engine.config import Timings
from kdn.layout import KVLayout
from kdn.model.hf import CacheDecoder, full_cache

log = logging.getLogger(__name__)


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op off CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


GROW_S = 0.1
"""On a GPU the calibration also times prefills of twice, four times... its length while the
last took under this many seconds (up to ``GROW_X`` times its length, and the model's
context): a GPU's speed per token at 256 tokens is a fraction of its speed at thousands (its
cores not yet busy), so a prompt of 8k predicted from 256 tokens would look ~1.5x slower to
recompute than it is, and a load slower than the prefill could be chosen. On a CPU the speed
per token changes less with the length and a prefill costs seconds: one length."""
GROW_X = 32


def time_prefill(model: Any, tokens: int, device: torch.device, grow_s: float = 0.0
                 ) -> tuple[list[tuple[int, float]], float]:
    """([(tokens, seconds)], step seconds): prefills of ``tokens`` tokens (fewer where the
    model's positions end sooner), doubled while the last took under ``grow_s`` seconds (at
    most ``GROW_X`` times ``tokens``; ``GROW_S``), each the best of three after a short
    warm-up forward, ``device`` synchronised; and one token's forward after the longest (what
    a hit's suffix costs at least: ``LoadingController.calibrate_step``), the best of three."""
    mcfg = getattr(model, "config", None)
    limit = getattr(mcfg, "max_position_embeddings", None)
    most = limit - 1 if isinstance(limit, int) and limit > 1 else math.inf
    vocab = getattr(mcfg, "vocab_size", None)
    vocab = vocab if isinstance(vocab, int) and vocab > 0 else 256
    n = int(min(tokens, most))
    int(CacheDecoder(model, full_cache(model)).forward([3] * min(n, 16))[-1].argmax())
    got: list[tuple[int, float]] = []
    for _ in range(GROW_X.bit_length()):  # 1, 2, 4... GROW_X times the length at most
        ids = [(7 * i + 3) % vocab for i in range(n)]
        best = step = math.inf  # (after that warm-up)
        for _ in range(3):  # a busy spell rarely spans all three
            sync(device)
            t0 = time.perf_counter()  # as generate's first token:
            decoder = CacheDecoder(model, full_cache(model))
            int(decoder.forward(ids)[-1].argmax())
            sync(device)
            best = min(best, time.perf_counter() - t0)
            t0 = time.perf_counter()  # a hit's suffix of one token, after the context (n + 1
            int(decoder.forward(ids[:1])[-1].argmax())  # positions: within the model's)
            sync(device)
            step = min(step, time.perf_counter() - t0)
        got.append((n, best))
        longer = int(min(2 * n, most, GROW_X * tokens))
        if not (best < grow_s and longer > n):
            break
        n = longer
    return got, step


def time_decodes(controller: LoadingController, encodings: tuple[tuple[str, str], ...],
                 layout: KVLayout, chunk_tokens: int, device: torch.device) -> None:
    """Time the decode of one block of ``chunk_tokens`` tokens of random KV on ``device`` for
    each of ``encodings`` whose speed there ``controller`` neither knows nor has a prior for,
    and give it to ``controller``."""
    todo = [(m, lv) for m, lv in encodings if not controller.knows_decode(encoding_name(m, lv))]
    if not todo:
        return
    c = chunk_tokens
    g = torch.Generator().manual_seed(c)
    # k, v: [kv_heads, tokens, channels] per layer, in the stored dtype
    kv = KVCache(layout, [tuple(torch.randn(lay.kv_heads, c, ch, generator=g)  # type: ignore[misc]
                                .to(layout.dtype.torch)
                                for ch in (lay.k_channels, lay.v_channels))
                          for lay in layout.layers])
    for mode, level in todo:
        name = encoding_name(mode, level)
        try:
            blob = codec.encode(kv, mode, level)
        except Exception as exc:  # an encoding this layout can not take: no calibration
            log.warning("decode calibration of %s skipped: %s", name, exc)
            continue
        best = math.inf
        for _ in range(2):
            sync(device)
            t0 = time.perf_counter()
            codec.decode(blob, device=device)
            sync(device)
            best = min(best, time.perf_counter() - t0)
        controller.calibrate_decode(name, c * layout.bytes_per_token, best)


def observe_request(controller: LoadingController, streams: list[LayerStream], choice: str,
                    reused: int, t: Timings, path: str, server: str,
                    bytes_per_token: int) -> None:
    """Teach ``controller`` what a request took: the bandwidth of each path its ``streams``
    came by (``path`` and ``server`` for those not in the process) and the hit's cost in
    encoding ``choice`` (``reused`` tokens of ``bytes_per_token``); without streams, the
    prefill's speed. Fills ``t``'s ``local_blocks``, ``transfer_s`` and ``decode_s``."""
    t.local_blocks = sum(s.blocks for s in streams if s.in_process)
    remote = [s for s in streams if not s.in_process]
    inproc = [s for s in streams if s.in_process]
    for group, kind, host in ((remote, path, server), (inproc, IN_PROCESS, "")):
        if group:  # each path's bandwidth, from what crossed it
            start = min(s.timings.started for s in group)
            last = max(s.timings.last_frame_received for s in group)
            nbytes = sum(s.timings.bytes_received for s in group)
            controller.observe_transfer(nbytes, max(0.0, last - start), kind, host, choice)
    if streams:
        start = min(s.timings.started for s in streams)
        last = max(s.timings.last_frame_received for s in streams)
        ready = max(max(s.timings.layer_ready.values()) for s in streams)
        t.transfer_s = max(0.0, last - start)
        t.decode_s = max(0.0, ready - last)
        kv_bytes = reused * bytes_per_token
        # what the hit cost beyond the transfer, end to end: on a GPU the copies and
        # decodes the streams queued finish only by the first token, after the streams
        # said ready; the suffix computed is taken out at the learnt prefill speed
        spent = (t.ttft_s - t.lookup_s - t.transfer_s
                 - controller.suffix_seconds(t.computed_tokens))
        controller.observe_hit(choice, kv_bytes, t.transfer_s,
                               t.transfer_s + max(t.decode_s, spent, 1e-4),
                               local=not remote, path=path, server=server)
    else:
        controller.observe_prefill(t.computed_tokens, t.first_token_compute_s)
