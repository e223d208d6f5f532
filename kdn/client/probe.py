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

Probing is best effort: any failure (no server, a read-only tenant, a full quota) returns None
and the controller keeps its prior.
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kdn.cache import KVCache
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


def _read(client: Client, key: bytes, namespace: str) -> float:
    local = client.local
    if local is not None:
        local.discard(namespace, key)
    time.sleep(PAUSE_S)
    t0 = time.perf_counter()
    stream = client.retrieve_streams([key], namespace=namespace, layout=PROBE_LAYOUT)[0]
    if stream is None:
        raise LookupError("a probe entry went missing")
    for i in range(_LAYERS):
        stream.wait_for_layer(i)
    seconds = time.perf_counter() - t0
    if local is not None:
        local.discard(namespace, key)
    return seconds


def probe_link(client: Client, namespace: str | None = None, rounds: int = 2
               ) -> LinkProbe | None:
    """Measure the path from ``client``'s server to it (module docstring); None when it can
    not be measured."""
    ns = namespace or client.namespace
    try:
        ks = [probe_key(n) for n in SIZES]
        present = client.lookup(ks, namespace=ns).infos
        for n, key, info in zip(SIZES, ks, present):
            if not info.present:
                client.store(key, _entry(n), mode="raw", namespace=ns)
        best = [min(_read(client, key, ns) for _ in range(max(1, rounds))) for key in ks]
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
