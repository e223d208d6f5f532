"""Where a GPU decode's time goes, beside its wall time (``bench.gpu``'s decode and hit rows):
the host seconds of each step (``kdn.codec.gpu_source.SECONDS``), the kernels' device time
(torch.profiler), launches and host synchronisations per entry (``gpu_batch.STATS``), and a
cProfile of the host (``--profile-decode``)."""

from __future__ import annotations

from typing import Any

import torch

from kdn.codec import gpu_source


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile(title: str, fn: Any, device: torch.device) -> None:
    import cProfile
    import io
    import pstats

    sync(device)
    prof = cProfile.Profile()
    prof.enable()
    fn()
    sync(device)
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
    print(f"  profile, {title}:\n" + "\n".join(
        line for line in text.getvalue().splitlines()[4:] if line.strip()), flush=True)


def phases(before: dict[str, float]) -> dict[str, float]:
    """Host seconds by step of the whole-entry decodes and their landing since ``before`` (a
    copy of ``kdn.codec.gpu_source.SECONDS``): where ``host_start_load_s`` goes, the rest
    being lookup, reads and Python around them."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(gpu_source.SECONDS.items())
            if v > before.get(k, 0.0)}


def decode_counts(blobs: list[bytes], device: torch.device) -> dict[str, float]:
    """Kernel launches and host synchronisations per entry of the whole-entry decoder
    (``kdn.codec.gpu_batch.STATS``); zeros where an encoding does not use it."""
    from kdn import codec

    if device.type != "cuda":
        return {"launches": 0.0, "host_syncs": 0.0}
    from kdn.codec import gpu_batch

    before = dict(gpu_batch.STATS)
    for b in blobs:
        codec.decode(b, device=device)
    sync(device)
    n = max(len(blobs), 1)
    return {"launches": (gpu_batch.STATS["launches"] - before["launches"]) / n,
            "host_syncs": (gpu_batch.STATS["syncs"] - before["syncs"]) / n}


def kernel_seconds(fn: Any, device: torch.device) -> float | None:
    """Seconds the device spent in kernels (copies and fills excluded) during ``fn``."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync(device)
    total_us = 0.0
    for evt in prof.events():
        name = evt.name.lower()
        on_device = "cuda" in str(getattr(evt, "device_type", "")).lower()
        if on_device and "memcpy" not in name and "memset" not in name:
            total_us += evt.device_time
    return total_us / 1e6 or None
