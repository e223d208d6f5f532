"""What the loading controller assumes before it has measured anything, and what an engine
stores where its config names no encoding: the options' names, the kinds of path a hit takes
(and the keys of a route, ``route_key``, and of an option on it, ``option_key``),
decode-speed and bandwidth priors, and the default encodings per device and path
(``kdn.delivery.controller`` learns from there)."""

from __future__ import annotations

from kdn.errors import ConfigError

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


IN_PROCESS = "in-process"
"""The client's in-process tier: no link, a copy in memory (or none)."""
SAME_HOST = "same-host"
"""A server on the engine's host: the shared segment / read arena (or gRPC over loopback)."""
NETWORK = "network"
"""A server on another host: the network data path or gRPC."""
PATHS = (IN_PROCESS, SAME_HOST, NETWORK)

PATH_PRIORS_B_S: dict[str, float] = {
    IN_PROCESS: 20e9,
    SAME_HOST: 5e9,
    NETWORK: 0.5e9,
}
"""Bandwidth (bytes/s) per path kind before any retrieve over it is observed. In-process: a
memory copy at most (README benchmarks: an in-process hit on an H100/H200 runs at 0.84-0.93x
of a pinned host-to-device copy, tens of GB/s; 20 GB/s is a low memcpy figure). Same-host:
5 GB/s, within what ``bench.peers`` measured for same-host puts on the 2-core CPU host
(2.6-7.6 GB/s for 1-256 MiB) and below the same-host GPU hits of ``bench.gpu`` (36-46 GB/s
on an H100), which are learnt once seen. Network: 0.5 GB/s (4 Gbit/s), the controller's
former single link prior."""


def path_priors(given: dict[str, float]) -> dict[str, float]:
    """A copy of ``PATH_PRIORS_B_S`` with the priors ``given`` for some path kinds; a name
    that is no path kind is a ConfigError."""
    unknown = sorted(map(str, set(given) - set(PATHS)))
    if unknown:
        raise ConfigError(f"priors_b_s names no path kind: {', '.join(unknown)} (the kinds "
                          f"are {', '.join(PATHS)})")
    return {**PATH_PRIORS_B_S, **given}


def route_key(local: bool, path: str, server: str) -> str:
    """Where a hit comes from: the in-process tier, or ``path`` from ``server``."""
    if local:
        return IN_PROCESS
    return f"{path}@{server}" if server else path


def option_key(option: str, local: bool, path: str, server: str) -> str:
    """Where the controller keeps what it learnt of ``option``: an encoding per route, a
    recompute wherever it ran."""
    return option if option == RECOMPUTE else f"{option}@{route_key(local, path, server)}"


def default_encodings(device: str, path: str) -> tuple[tuple[str, str], ...]:
    """The (mode, level) pairs an engine stores when its config names none: what pays off
    where it runs (``device``: its model's device type; ``path``: how its hits arrive, one of
    ``PATHS``).

    - A CPU computes KV slowly and decodes any encoding fast next to that (``bench.codec``:
      decoding takes 1-2% of the prefill's time): ``lossless``, exact and smaller than
      ``raw``, wins on every path there.
    - A GPU prefills an 8B model at ~30k tokens/s (``bench.gpu``, H200): only bytes that are
      already near it, moved at tens of GB/s and not decoded, beat that. On the engine's own
      host (a shared segment, the in-process tier) that is ``raw`` (0.16-0.33x the prefill);
      ``lossless`` decodes on the host at ~1 GB/s and loses to recomputing.
    - A GPU whose server is across a network gets ``kdn-default`` (~7x smaller than fp16:
      the hit a 10 Gbit/s link can carry in time) and ``raw`` beside it (what a link of 25
      Gbit/s and more carries faster than the GPU decodes); both are stored and charged, and
      the controller picks per request by the link it measured.
    """
    if device.split(":")[0] != "cuda":
        return (("lossless", ""),)
    if path == NETWORK:
        return (("kdn", "default"), ("raw", ""))
    return (("raw", ""),)
