"""The loading controller (CacheGen's idea): per request, fetch which encoding, or recompute?

Inputs, all measured: link bandwidth (bytes/s of recent retrieves), decode speed per encoding
and device (fp16-equivalent bytes/s), the model's prefill speed (tokens/s), and the stored
size of each encoding of the requested context (from one batched Lookup). For each available
encoding the time to usable KV is ``size / bandwidth + kv_bytes / decode_speed``; recomputing
costs ``tokens / prefill_speed``. The cheapest wins. Every decision is logged and counted; a request
may force a choice (``override``).

Speeds start from conservative priors and follow observations as exponentially weighted means,
so the controller adapts when the link or the machine changes.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

RECOMPUTE = "recompute"


def encoding_name(mode: str, level: str = "") -> str:
    return f"{mode}-{level}" if level else mode


DECODE_PRIORS_B_S: dict[tuple[str, str], float] = {
    ("raw", "cuda"): 30e9,
    ("int8", "cuda"): 9e9,
    ("kdn", "cuda"): 7e9,
    ("lossless", "cuda"): 1.2e9,
    ("cachegen", "cuda"): 0.3e9,
}
"""Decode speed (fp16-equivalent bytes/s) per (mode, device type) before any is observed:
what an 8B-shaped hit loaded at on the same host in ``bench.gpu`` (H200, 2026-11-28: raw
29-41 GB/s, int8 9-12, kdn levels 7-11 with the whole-entry GPU decoder, lossless 1.2 with
its host zstd). A CPU has none: 1 GB/s until observed, as before."""


@dataclass(frozen=True)
class Decision:
    choice: str
    """An encoding name (``encoding_name(mode, level)``, e.g. ``lossless``, ``kdn-default``) or
    ``recompute``."""
    estimates_s: dict[str, float]
    reason: str


@dataclass
class LoadingController:
    bandwidth_b_s: float = 0.5e9
    """Prior link bandwidth (bytes/s) until retrieves are observed."""
    prefill_tok_s: float = 500.0
    """Prior prefill speed (tokens/s) until prefills are observed."""
    decode_b_s: dict[str, float] = field(default_factory=dict)
    """Decode speed (fp16-equivalent bytes/s) per ``"<encoding>@<device>"``: a GPU decodes
    the compressed modes far faster than a CPU, so what wins on one host loses on another;
    ``DECODE_PRIORS_B_S`` (else 1 GB/s) until observed."""
    device: str = "cpu"
    """Where the engine decodes (its model's device type): the key's default device."""
    alpha: float = 0.3
    """Weight of a new observation in the running means."""
    counts: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def observe_transfer(self, nbytes: int, seconds: float) -> None:
        if nbytes > 0 and seconds > 0:
            with self._lock:
                self.bandwidth_b_s = self._ewma(self.bandwidth_b_s, nbytes / seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0 and seconds > 0:
            with self._lock:
                self.prefill_tok_s = self._ewma(self.prefill_tok_s, tokens / seconds)

    def _key(self, encoding: str, device: str | None) -> str:
        return f"{encoding}@{device or self.device}"

    def observe_decode(self, encoding: str, kv_bytes: int, seconds: float,
                       device: str | None = None) -> None:
        if kv_bytes > 0 and seconds > 0:
            key = self._key(encoding, device)
            with self._lock:
                old = self.decode_b_s.get(key, kv_bytes / seconds)
                self.decode_b_s[key] = self._ewma(old, kv_bytes / seconds)

    def decode_speed(self, encoding: str, device: str | None = None) -> float:
        """Learnt decode speed of ``encoding`` on ``device`` (bytes/s); until one is seen, the
        prior of its mode on that kind of device (``DECODE_PRIORS_B_S``), else 1 GB/s."""
        learnt = self.decode_b_s.get(self._key(encoding, device))
        if learnt is not None:
            return learnt
        kind = (device or self.device).split(":")[0]
        return DECODE_PRIORS_B_S.get((encoding.split("-")[0], kind), 1e9)

    def estimate(self, encoding: str, stored_bytes: int, kv_bytes: int,
                 local: bool = False) -> float:
        """Seconds to usable KV: transfer (none for an entry in the engine's own process) plus
        decode on this controller's device."""
        transfer = 0.0 if local else stored_bytes / self.bandwidth_b_s
        return transfer + kv_bytes / self.decode_speed(encoding)

    def choose(self, tokens: int, kv_bytes: int, stored: dict[str, int],
               override: str | None = None, local: frozenset[str] = frozenset()) -> Decision:
        """Pick for ``tokens`` tokens whose KV is ``kv_bytes`` bytes; ``stored`` maps each
        available encoding to its stored size (a missing encoding is simply absent); ``local``
        names the encodings the in-process tier holds."""
        est = {enc: self.estimate(enc, size, kv_bytes, enc in local)
               for enc, size in stored.items()}
        est[RECOMPUTE] = tokens / self.prefill_tok_s if tokens else 0.0
        if override is not None:
            if override != RECOMPUTE and override not in stored:
                choice, reason = RECOMPUTE, f"override {override!r} not stored; recomputing"
            else:
                choice, reason = override, "override"
        elif not stored:
            choice, reason = RECOMPUTE, "nothing stored"
        else:
            choice = min(est, key=lambda k: est[k])
            reason = "fastest estimate"
        with self._lock:
            self.counts[choice] += 1
        log.info("controller: %d tokens -> %s (%s; estimates %s)", tokens, choice, reason,
                 {k: round(v, 4) for k, v in est.items()})
        return Decision(choice, est, reason)
