"""How fast a client receives entries from its server, measured before the first hit.

The loading controller weighs a hit's stored bytes against the bandwidth of the path they take.
Its prior for a network (``kdn.delivery.PATH_PRIORS_B_S``: 0.5 GB/s) is off by 4x on a 1 Gbit/s
link and 25x on a 100 Gbit/s one, and a freshly made engine would decide on it. ``probe_link``
measures the path instead:

1. two probe entries of known sizes (``SIZES``, both above the burst an egress cap lets through
   at once: ``kdn.server.egress.BURST_BYTES``) are stored under fixed keys in the caller's
   namespace, once per server (a later probe finds them), ``raw``, so decoding adds nothing;
2. each is read back the way an engine reads a hit's blocks (``Client.retrieve_streams``, every
   layer waited for), after a pause that lets an egress cap's bucket refill, best of
   ``rounds``; a copy the client's in-process tier kept is dropped, so every read crosses the
   path;
3. the bandwidth is the difference of the two sizes over the difference of the two times: what
   one read costs whatever its size (the call, the lookup, the first burst) cancels out.

A probe has a budget (``budget_s``): its calls on the network data path all end within it
(``kdn.client.deadline.deadline_within``), whatever the client's ``timeout_s``. On a link too
slow to carry the entries within it, the probe says what the reads showed: the smaller
entry's own rate where it came in (a lower bound), else its size over the time its reads
took (an upper bound: the link is slower than that). A read the client's own ``timeout_s``
ends first is taken the same way.

Probing is best effort: any failure (no server, a read-only tenant, a full quota) returns None
and the controller keeps its prior.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kdn.cache import KVCache
from kdn.client.deadline import deadline_within
from kdn.errors import DeadlineExceeded
from kdn.layout import DType, KVLayout, LayerLayout

if TYPE_CHECKING:
    from kdn.client.client import Client

log = logging.getLogger(__name__)

SIZES = (8 << 20, 40 << 20)
"""Bytes of the two probe entries: the smaller one above an egress cap's burst (4 MiB), the
difference large enough that a 100 Gbit/s link still takes milliseconds to carry it."""
PAUSE_S = 0.06
"""Pause before each read: an egress cap's bucket holds at most 50 ms of its rate, so it is
full again after this (each read then starts as a hit after a quiet spell would)."""

BUDGET_S = 30.0
"""Seconds a probe takes at most by default (a 1 Gbit/s link carries its 96 MiB of reads in
1 s, a 100 Mbit/s one in 8)."""

_LAYERS, _CHANNELS = 8, 128
PROBE_LAYOUT = KVLayout(
    model_fingerprint="kdn-link-probe-v1",
    layers=tuple(LayerLayout(kv_heads=1, k_channels=_CHANNELS, v_channels=_CHANNELS)
                 for _ in range(_LAYERS)),
    dtype=DType.FLOAT16, head_dim=_CHANNELS, model_name="kdn link probe")
"""Eight layers, one head of 128 channels, fp16: 4 KiB of KV per token."""


@dataclass(frozen=True)
class LinkProbe:
    bytes_per_s: float
    """Bandwidth of the path, from the two sizes' difference."""
    fixed_s: float
    """What a read costs whatever its size (the smaller read's time beyond its bytes)."""
    seconds: tuple[float, float]
    """Best read time of each probe entry (``SIZES`` order)."""


def probe_key(nbytes: int) -> bytes:
    """The fixed key of the probe entry of ``nbytes`` bytes (the same on every host)."""
    return hashlib.sha256(b"kdn/link-probe/v1/%d" % nbytes).digest()


def _entry(nbytes: int) -> KVCache:
    tokens = nbytes // PROBE_LAYOUT.bytes_per_token
    # k, v: [kv_heads=1, tokens, channels]; a pattern no tier could shorten
    base = torch.arange(tokens * _CHANNELS, dtype=torch.int32).remainder_(2039)
    layer = base.to(torch.float16).reshape(1, tokens, _CHANNELS)
    return KVCache(PROBE_LAYOUT, [(layer, layer) for _ in range(_LAYERS)])


def _read(client: Client, key: bytes, namespace: str, until: float) -> float:
    local = client.local
    if local is not None:
        local.discard(namespace, key)
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    stream = client.retrieve_streams([key], namespace=namespace, layout=PROBE_LAYOUT)[0]
    if stream is None:
        raise LookupError("a probe entry went missing")
    try:
        for i in range(_LAYERS):
            stream.wait_for_layer(i, max(0.0, until - time.monotonic()))
    except TimeoutError:
        stream.cancel()
        raise DeadlineExceeded("the probe's budget ran out") from None
    seconds = time.perf_counter() - t0
    if local is not None:
        local.discard(namespace, key)
    return seconds


def probe_link(client: Client, namespace: str | None = None, rounds: int = 2,
               budget_s: float = BUDGET_S) -> LinkProbe | None:
    """Measure the path from ``client``'s server to it (module docstring), within
    ``budget_s`` seconds; None when it can not be measured."""
    ns = namespace or client.namespace
    until = time.monotonic() + budget_s
    best: list[float] = []
    reads_from = math.inf
    try:
        with deadline_within(budget_s):
            ks = [probe_key(n) for n in SIZES]
            present = client.lookup(ks, namespace=ns, timeout_s=budget_s).infos
            for n, key, info in zip(SIZES, ks, present):
                if not info.present:
                    client.store(key, _entry(n), mode="raw", namespace=ns)
            reads_from = time.monotonic()
            for key in ks:
                best.append(min(_read(client, key, ns, until) for _ in range(max(1, rounds))))
    except (DeadlineExceeded, TimeoutError) as exc:
        if best:  # the smaller entry came in: its own rate, the read's fixed cost in it
            rate = SIZES[0] / best[0]
        elif time.monotonic() > reads_from:  # not even that one: slower than this
            rate = SIZES[0] / max(time.monotonic() - reads_from, 1e-3)
        else:
            log.warning("link probe of %s failed: %s", client.address, exc)
            return None
        log.warning("link probe of %s cut short (%s; budget %g s): about %.3g MB/s",
                    client.address, exc, budget_s, rate / 1e6)
        return LinkProbe(rate, 0.0, (best[0] if best else math.inf, math.inf))
    except Exception as exc:  # best effort: the controller keeps its prior
        log.warning("link probe of %s failed: %s", client.address, exc)
        return None
    small, large = best
    if large > small:
        rate = (SIZES[1] - SIZES[0]) / (large - small)
    else:  # too fast to tell the sizes apart: the larger read's own rate, a lower bound
        rate = SIZES[1] / large
    fixed = max(0.0, small - SIZES[0] / rate)
    log.info("link probe of %s: %.2f GB/s, %.2f ms per read", client.address, rate / 1e9,
             fixed * 1e3)
    return LinkProbe(rate, fixed, (small, large))
