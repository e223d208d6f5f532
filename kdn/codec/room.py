"""Whether the host or the device can hold what an entry decodes to, asked before a decoder
allocates.

A compressed entry bounds nothing about its decoded size: a constant cache costs its entropy
tables alone, so tens of kilobytes under a header may declare a million tokens (68 GB for 32
layers of 8 heads of 64 channels). Decoded, such an entry had the kernel kill the reader, and
on a GPU ended in torch's out-of-memory error. Decoders ask ``check_room`` first and refuse,
as TooLarge, what can not fit where they decode to; on the CPU with what the decoders hold
while they run (``Mode.decode_work_bytes``: a kdn or cachegen layer's int32 symbols, twice its
float16 output), for as many layers as decode at once (``StreamDecoder``).

The room is an upper bound of what the process could get, so that nothing that fits is
refused: on the host, its MemAvailable, and where the process runs in a memory cgroup (a
container, a pod) its limit less what it uses, page cache counted as free; on a CUDA device,
its memory less what this process's tensors hold (torch's own counts: no call to the driver,
which a hit would wait on; what other processes hold there is not counted, and an allocation
it leaves short of room fails as TooLarge where it is made: ``gpu_batch``)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from kdn.errors import TooLarge

ROOM_CHECKED_BYTES = 256 << 20
"""Entries declaring fewer decoded bytes than this are decoded without asking the host."""

_CGROUPS = (  # (limit, usage, stat, the stat line of its page cache) as a container sees them
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat",
     "file"),
    ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
     "/sys/fs/cgroup/memory/memory.stat", "total_cache"),
)


def _number(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat(path: str, name: str) -> int:
    try:
        for line in Path(path).read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == name and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0


def _meminfo() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def host_room() -> int | None:
    """Bytes of memory this process could get without swapping (module docstring), or None
    where the host does not say."""
    rooms = [r for r in [_meminfo()] if r is not None]
    for limit_at, usage_at, stat_at, cache in _CGROUPS:
        limit, usage = _number(limit_at), _number(usage_at)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1: no limit ~ 2**63
            rooms.append(max(0, limit - usage + _stat(stat_at, cache)))
    return min(rooms) if rooms else None


def device_room(device: torch.device) -> int | None:
    """Bytes a CUDA ``device`` could give this process at most (module docstring), or None
    for a device that does not say (not CUDA)."""
    if device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int(total) - torch.cuda.memory_allocated(device))


def check_room(declared: int, tokens: int, what: str = "decodes to",
               device: torch.device | None = None, work: int = 0) -> None:
    """TooLarge where an entry whose header declares ``declared`` bytes of decoded tensors (of
    ``tokens`` tokens), or of a decoder's working memory (``what`` says which), with ``work``
    bytes more that its decoders hold while they run, could not be held in this process's
    memory (``device``: None or the CPU) or on ``device``."""
    if declared + work < ROOM_CHECKED_BYTES:
        return
    if device is None or device.type == "cpu":
        room, where = host_room(), "this host has"
    else:
        room, where = device_room(device), f"device {device} has"
    if room is not None and declared + work > room:
        more = f", and its decoders {work / 2**30:.1f} GiB more at once" if work else ""
        raise TooLarge(f"the entry {what} {declared / 2**30:.1f} GiB ({tokens} tokens){more}; "
                       f"{where} {room / 2**30:.1f} GiB of memory available")
