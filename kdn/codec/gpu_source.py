"""How the bytes of a whole-entry GPU decode (``kdn.codec.gpu_batch``) reach the device: the
bodies (``Source``: copied where they lie when page-locked, else packed into pinned staging by
several threads), the planner's arrays laid out in one pinned buffer sent in one copy
(``Staging``), the staging threads the planner's compiled work runs on (``run_all``), and
the launch of a kernel on its tensors' device (``launch``).
"""

from __future__ import annotations

import os
import time
import warnings
from typing import Any

import numpy as np
import torch

from kdn.pools import SharedPool

STATS = {"launches": 0, "copies": 0, "syncs": 0}
"""Kernel launches, host-to-device copies and host synchronisations of whole-entry decodes
(counted where they are issued; tests read them to hold the per-entry budget)."""

SECONDS: dict[str, float] = {}
"""Host seconds spent in each step of whole-entry decodes and of the landing that prepares
them, by step name (``lap``): where a hit's host time goes on the GPU host, which
``bench.gpu`` records beside each hit row."""


def record_ready(device: torch.device) -> Any:
    """An event recorded on this thread's current stream of ``device`` after the work queued
    there (a whole-entry decode's copies and launches); None off CUDA. A consumer on another
    stream, or another thread (whose current stream is its own), waits for it before it reads
    the decode's flag or tensors (``await_ready``)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def await_ready(ready: Any, device: torch.device) -> None:
    """This thread's current stream of ``device`` waits for ``ready`` (``record_ready``) on the
    device: later work queued there runs after it; the host does not wait."""
    if ready is not None:
        torch.cuda.current_stream(device).wait_event(ready)


def lap(step: str, since: float) -> float:
    """Add the time since ``since`` (a ``time.perf_counter()`` reading) to ``step`` in
    ``SECONDS``; the reading now, to time the next step from."""
    now = time.perf_counter()
    SECONDS[step] = SECONDS.get(step, 0.0) + (now - since)
    return now

SPAN_GAP = 64 << 10
"""Bytes between two bodies of one buffer that a device copy carries along rather than
start another copy for (``Source``)."""
DIRECT = {"cuda"}
"""Device types whose pinned bodies are copied where they lie, a copy per run of bodies, when
they do not lie in one span (tests add "cpu", so that CI runs that path too)."""


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **meta: Any) -> None:
    """``kernel[grid](*args, **meta)`` on the device of its tensors (``args[0]`` is one).
    Triton launches on the calling thread's current device and that device's current stream,
    which need not be the tensors' (a model on cuda:1 in a process whose current device is
    cuda:0; any worker thread, the current device being per thread): Triton then refuses the
    pointers ("cannot be accessed from Triton") or, with peer access on, runs the kernel on
    cuda:0, unordered with the copies queued for it on cuda:1."""
    device = args[0].device
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[grid](*args, **meta)
    else:  # Triton's interpreter: CPU tensors
        kernel[grid](*args, **meta)


def queue_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` filled from ``src``: a copy queued on the current stream (non-blocking from
    pinned memory to a GPU). ``bench.plan_host`` counts these instead, to time the host's share
    of a decode on a host whose "device" copies would be memcpys."""
    dst.copy_(src, non_blocking=True)


def address(mv: memoryview) -> int:
    return int(np.frombuffer(mv, dtype=np.uint8).ctypes.data) if len(mv) else 0


class Source:
    """The bodies' bytes as one uint8 tensor on the device, each body's offset in it
    (``offsets``), and the host bytes the planner reads (``array``, each body at
    ``host_offsets``).

    ``pinned``: the bodies lie in page-locked or CUDA-registered memory (a registered segment
    or arena, the pinned in-process tier, landed network buffers), which copies read in place:
    one copy where the bodies lie in one span, else one copy per run of neighbouring bodies
    (``DIRECT``: each entry of a context is typically one run), with nothing copied on the
    host. The planner then reads the bodies where they lie too (``host_view``: one buffer
    holds them all: views of views, such as the read arena's entries, count as the buffer
    they view, ``_owners``), and ``to_device`` maps its offsets to the device buffer's; bodies
    in several buffers are copied into one host array for it (the ``kdn`` planner reads one
    buffer; ``int8``'s needs none: ``host_view=False``). Other memory is first copied into a
    pinned staging buffer by several threads (a copy from pageable memory runs at a fraction
    of the link's rate and blocks the host throughout). ``addresses``: where each body lies,
    when the caller knows (``codec.api.entry_bodies``: ~3 us a body less than asking numpy)."""

    def __init__(self, bodies: list[memoryview], device: torch.device,
                 pinned: bool = False, *, host_view: bool = True,
                 addresses: list[int] | None = None) -> None:
        owner = _owners(bodies)
        owners = set(map(id, owner))
        addr = addresses if addresses is not None else [address(b) for b in bodies]
        sizes = [len(b) for b in bodies]
        nonempty = [i for i, n in enumerate(sizes) if n]
        lo = min((addr[i] for i in nonempty), default=0)
        hi = max((addr[i] + sizes[i] for i in nonempty), default=0)
        start, whole = -1, np.empty(0, np.uint8)
        if len(owners) == 1 and nonempty:
            whole = owner[nonempty[0]]
            start = lo - int(whole.ctypes.data)
        host: np.ndarray | None = None
        in_whole = 0 <= start and start + hi - lo <= len(whole)
        one_span = in_whole and hi - lo <= 2 * sum(sizes) + (1 << 20)
        self.delta: np.ndarray | None = None
        if pinned and not one_span and nonempty and device.type in DIRECT:
            self._direct(bodies, owner, addr, sizes, nonempty, device,
                         whole if in_whole else None, host_view)
            return
        stage = device.type == "cuda" and not (pinned and one_span)  # copied anyway: pinned
        if one_span:
            host = whole[start : start + hi - lo]
            self.offsets = [a - lo if n else 0 for a, n in zip(addr, sizes)]
            pieces, total = [(0, host)], hi - lo
        else:
            pieces, self.offsets, total = _packing(bodies)
        if stage:
            t = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
            host = t.numpy()
            _copy_into(host, pieces)
        else:
            if host is None:
                host = np.empty(max(total, 1), dtype=np.uint8)
                _copy_into(host, pieces)
            t = _tensor(host)
        self.host_offsets = self.offsets
        self.array = host if len(host) else np.zeros(1, np.uint8)
        self.host: Any = t  # the copy's source (read asynchronously: alive until checked)
        self.tensor = t.to(device, non_blocking=True) if device.type != "cpu" else t
        STATS["copies"] += device.type != "cpu"

    def _direct(self, bodies: list[memoryview], owner: list[np.ndarray], addr: list[int],
                sizes: list[int], nonempty: list[int], device: torch.device,
                whole: np.ndarray | None, host_view: bool) -> None:
        """One device copy per run of bodies that lie within ``SPAN_GAP`` of each other in
        one buffer, read where they lie."""
        order = sorted(nonempty, key=lambda i: (id(owner[i]), addr[i]))
        runs: list[tuple[list[int], int, int]] = []  # (bodies, start address, end address)
        for i in order:
            r = runs[-1] if runs else None
            if (r is not None and owner[i] is owner[r[0][0]]
                    and addr[i] <= r[2] + SPAN_GAP):
                r[0].append(i)
                runs[-1] = (r[0], r[1], max(r[2], addr[i] + sizes[i]))
            else:
                runs.append(([i], addr[i], addr[i] + sizes[i]))
        self.offsets = [0] * len(bodies)
        at, sources = 0, []
        for members, a, b in runs:
            base = owner[members[0]]
            off = a - int(base.ctypes.data)
            if 0 <= off and off + (b - a) <= len(base):
                sources.append((at, base[off : off + (b - a)]))
                for i in members:
                    self.offsets[i] = at + addr[i] - a
                at += b - a
            else:  # not a view of its owner's one buffer: each body a copy of its own
                for i in members:
                    sources.append((at, np.frombuffer(bodies[i], dtype=np.uint8)))
                    self.offsets[i] = at
                    at += sizes[i]
        out = torch.empty(max(at, 1), dtype=torch.uint8, device=device)
        held = []
        for d, src in sources:
            t = _tensor(src)
            queue_copy(out[d : d + len(src)], t)
            held.append(t)
        STATS["copies"] += len(sources)
        if whole is not None and host_view:  # the planner reads the one buffer in place
            base_addr = int(whole.ctypes.data)
            self.host_offsets = [a - base_addr if n else 0 for a, n in zip(addr, sizes)]
            self.array = whole
        elif host_view:  # several buffers: the planner's copy (one host array)
            pieces, self.host_offsets, total = _packing(bodies)
            self.array = np.empty(max(total, 1), dtype=np.uint8)
            _copy_into(self.array, pieces)
        else:
            self.host_offsets, self.array = self.offsets, np.zeros(1, np.uint8)
        self.delta = np.array(self.offsets, np.int64) - np.array(self.host_offsets, np.int64)
        self.host = held
        self.tensor = out


def _packing(bodies: list[memoryview]
             ) -> tuple[list[tuple[int, np.ndarray]], list[int], int]:
    """The bodies one after another: (offset, bytes) pieces for ``_copy_into``, each body's
    offset, and the total."""
    pieces, offsets, total = [], [], 0
    for b in bodies:
        pieces.append((total, np.frombuffer(b, dtype=np.uint8)))
        offsets.append(total)
        total += len(b)
    return pieces, offsets, total


def _owners(bodies: list[memoryview]) -> list[np.ndarray]:
    """The whole buffer each body lies in, as bytes: the same array for bodies of one buffer,
    however they were viewed. Views of numpy views (each entry of the read arena is an array
    of its own over the arena's mapping) are traced to the memory they view, so that the
    bodies of a context's entries are seen to lie in one buffer: the planner reads them
    there, where it would otherwise copy them all into one host array first."""
    seen: dict[int, np.ndarray] = {}
    out = []
    for b in bodies:
        obj = b.obj
        got = seen.get(id(obj))
        if got is None:
            got = seen[id(obj)] = _whole(b)
            root = _root(obj)
            if root is not obj:
                try:
                    whole = np.frombuffer(root, dtype=np.uint8)  # type: ignore[call-overload]
                except (TypeError, ValueError, BufferError):  # not one run of bytes
                    whole = None
                if whole is not None:  # the same array for every view of this memory
                    got = seen[id(obj)] = seen.setdefault(id(root), whole)
        out.append(got)
    return out


def _root(obj: Any) -> Any:
    """What a numpy view's memory is: up its chain of bases to the buffer that exports it (an
    mmap, bytes), or to the last array where the base above exports none (a tensor's)."""
    root = obj
    while isinstance(root, np.ndarray) and root.base is not None:
        up = root.base
        if not isinstance(up, np.ndarray):
            try:
                memoryview(up)
            except TypeError:
                break
        root = up
    return root


def _whole(body: memoryview) -> np.ndarray:
    """The whole buffer ``body`` is a view of, as bytes."""
    return np.frombuffer(body.obj, dtype=np.uint8)  # type: ignore[call-overload]


def _tensor(host: np.ndarray) -> torch.Tensor:
    """A CPU tensor over ``host``'s bytes (a read-only source is only read)."""
    if not len(host):
        return torch.zeros(1, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(host)


class Staging:
    """Host arrays laid out in one buffer (page-locked for a GPU) that the caller fills in
    place, then sent to the device with one copy (``send``: the device tensors by name)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.spans: dict[str, tuple[int, np.dtype[Any], int]] = {}
        self.total = 0
        self.host = torch.empty(0, dtype=torch.uint8)

    def add(self, name: str, dtype: Any, n: int) -> None:
        dt = np.dtype(dtype)
        self.spans[name] = (self.total, dt, max(n, 1))
        self.total += -(-max(n, 1) * dt.itemsize // 16) * 16

    def arrays(self) -> dict[str, np.ndarray]:
        self.host = torch.empty(max(self.total, 1), dtype=torch.uint8,
                                pin_memory=self.device.type == "cuda")
        flat = self.host.numpy()
        return {name: flat[at : at + n * dt.itemsize].view(dt)
                for name, (at, dt, n) in self.spans.items()}

    def send(self) -> dict[str, torch.Tensor]:
        dev = (self.host.to(self.device, non_blocking=True) if self.device.type != "cpu"
               else self.host)
        return {name: dev[at : at + n * dt.itemsize].view(_TORCH[dt.str])
                for name, (at, dt, n) in self.spans.items()}


_TORCH = {np.dtype(np.uint8).str: torch.uint8, np.dtype(np.int32).str: torch.int32,
          np.dtype(np.int64).str: torch.int64}


THREADS = min(8, os.cpu_count() or 1)


def layer_chunks(work: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive layer ranges of about equal ``work`` (one per thread)."""
    layers = len(work)
    parts = min(THREADS, layers)
    if parts <= 1:
        return [(0, layers)]
    edges = np.searchsorted(np.cumsum(work), np.arange(1, parts) * work.sum() / parts)
    bounds = sorted({0, layers, *(int(e) + 1 for e in edges if 0 <= e < layers - 1)})
    return list(zip(bounds[:-1], bounds[1:]))


def run_all(fn: Any, jobs: list[Any]) -> None:
    """``fn`` of every job, on the staging threads where there are several."""
    if len(jobs) < 2:
        for j in jobs:
            fn(j)
        return
    list(_COPIES.get().map(fn, jobs))


_COPY_CHUNK = 4 << 20
_COPIES = SharedPool(THREADS, "kdn-stage")


def _copy_into(dst: np.ndarray, pieces: list[tuple[int, np.ndarray]]) -> None:
    """Each (offset, bytes) piece copied into ``dst`` at its offset, in chunks spread over
    threads (numpy copies release the GIL: one core copies a few GB/s)."""
    jobs: list[list[tuple[int, np.ndarray]]] = [[]]  # pieces of about _COPY_CHUNK a job
    size = 0
    for at, p in pieces:
        for o in range(0, len(p), _COPY_CHUNK):
            part = p[o : o + _COPY_CHUNK]
            if size and size + len(part) > _COPY_CHUNK:
                jobs.append([])
                size = 0
            jobs[-1].append((at + o, part))
            size += len(part)

    def one(job: list[tuple[int, np.ndarray]]) -> None:
        for at, p in job:
            dst[at : at + len(p)] = p

    run_all(one, jobs if len(jobs) >= 4 else [[p for job in jobs for p in job]])
