"""The runs of ``bench.peers``: single puts and gets per size, batches, 4 KiB get latency, the
memcpy limit, the systems taking turns, and a filling cache's deletes (``Fill``); what each
(system, api, op, size) measured is kept in a ``Series``.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from bench.common import median, percentile, timed
from bench.peers_systems import MIB, Route, System, payload

BATCH_CALLS = 3
"""Batch calls (put, then gets) per route and run (``batch_run``)."""


@dataclass
class Series:
    """What one (system, api, op, size) measured over the runs."""

    system: str
    api: str
    op: str
    size: int
    count: int
    gbs: list[float] = field(default_factory=list)
    lat: list[float] = field(default_factory=list)

    def row(self) -> dict[str, Any]:
        return {"system": self.system, "api": self.api, "op": self.op,
                "size_mib": self.size / MIB, "count": self.count,
                "gb_s": max(self.gbs) if self.gbs else None,
                "median_gb_s": median(self.gbs) if self.gbs else None,
                "p50_ms": percentile(self.lat, 50) * 1e3, "p99_ms": percentile(self.lat, 99) * 1e3,
                "runs": [round(x, 4) for x in self.gbs]}


class Recorder:
    def __init__(self) -> None:
        self.series: dict[tuple[str, str, str, int], Series] = {}

    def get(self, system: str, api: str, op: str, size: int, count: int) -> Series:
        k = (system, api, op, size)
        if k not in self.series:
            self.series[k] = Series(system, api, op, size, count)
        return self.series[k]


def call_each(fn: Callable[[int], Any], count: int, check: Callable[[int, Any], bool],
              release: Callable[[Any], None], what: str) -> list[float]:
    """Seconds of ``fn(i)`` for each entry; results are checked and released between calls,
    outside the timed part."""
    lat = []
    for i in range(count):
        t = time.perf_counter()
        got = fn(i)
        lat.append(time.perf_counter() - t)
        if not check(i, got):
            raise RuntimeError(f"{what}: entry {i} came back different")
        release(got)
        del got
    return lat


@dataclass(frozen=True)
class Fill:
    """How a run treats what it stored."""

    bytes: int
    """Bytes a system keeps before its entries are deleted (the share of kdn's RAM tier a
    filling cache reaches); 0: every route's entries are deleted after its run (the old
    best case: later puts land in memory freed by earlier ones)."""


def room_for(system: System, nbytes: int, fill: Fill) -> None:
    """Before a put run of ``nbytes``: delete what ``system`` kept when the run would take it
    past ``fill.bytes`` (untimed); the run's keys are new either way."""
    if fill.bytes and system.kept + nbytes > fill.bytes and system.kept:
        system.routes()[0].clear()
        system.kept = 0


def after_put(system: System, route: Route, nbytes: int, fill: Fill) -> None:
    system.kept += nbytes
    if not fill.bytes:
        route.clear()
        system.kept = 0


def one_run(system: System, rec: Recorder, size: int, count: int, fill: Fill) -> None:
    """Put ``count`` new entries through every path of ``system``, each read back by every get
    of its route."""
    for p in system.routes():
        room_for(system, size * count, fill)
        base = system.next_index
        system.next_index += count
        lat = call_each(lambda i: p.put(base + i), count,  # noqa: B023
                        lambda i, got: True, lambda _: None, f"{system.name} put")
        t = time.perf_counter()
        p.flush()
        s = rec.get(system.name, p.put_api, "put", size, count)
        s.gbs.append(size * count / (sum(lat) + time.perf_counter() - t) / 1e9)
        s.lat += lat
        for api, get in p.gets.items():
            lat = call_each(lambda i: get(base + i), count,  # noqa: B023
                            lambda i, got: p.check(base + i, got),  # noqa: B023
                            p.release, f"{system.name} {api}")
            s = rec.get(system.name, api, "get", size, count)
            s.gbs.append(size * count / sum(lat) / 1e9)
            s.lat += lat
        after_put(system, p, size * count, fill)


def batch_run(system: System, rec: Recorder, size: int, count: int, fill: Fill) -> None:
    """Each batch route ``BATCH_CALLS`` times over (a put of new keys, its gets); a run's
    figure is all their bytes over all their seconds, as a single-entry run sums its
    ``count`` calls (one ~20 ms call alone says more about the VM's moment than about the
    system)."""
    for p in system.batch_routes():
        put_s: list[float] = []
        get_s: dict[str, list[float]] = {api: [] for api in p.gets}
        for _ in range(BATCH_CALLS):
            room_for(system, size * count, fill)
            base = system.next_index
            system.next_index += count
            t = time.perf_counter()
            p.put(base, count)
            p.flush()
            put_s.append(time.perf_counter() - t)
            for api, get in p.gets.items():
                t = time.perf_counter()
                gots = get(base, count)
                get_s[api].append(time.perf_counter() - t)
                if not p.check(base, gots):
                    raise RuntimeError(f"{system.name} {api}: a batch entry came back different")
                p.release(gots)
                del gots
            after_put(system, p, size * count, fill)
        for op, api, secs in [("batch_put", p.put_api, put_s),
                              *(("batch_get", api, xs) for api, xs in get_s.items())]:
            s = rec.get(system.name, api, op, size, count)
            s.gbs.append(size * count * len(secs) / sum(secs) / 1e9)
            s.lat += secs


def latency_run(system: System, rec: Recorder, gets: int, seed: int) -> None:
    """4 KiB gets of distinct keys: per get api, ``gets`` + 50 new entries stored (untimed),
    50 of them read untimed, then the others each read once in a random order (no api reads
    a key another read before: a client that keeps what it read answers it without a
    call)."""
    size = 4096
    for p in system.routes():
        for api, get in p.gets.items():
            base = system.next_index
            system.next_index += gets + 50
            for i in range(base, base + gets + 50):
                p.put(i)
            p.flush()
            order = list(range(base + 50, base + 50 + gets))
            random.Random(seed).shuffle(order)
            call_each(lambda i: get(base + i), 50,  # noqa: B023
                      lambda i, got: p.check(base + i, got),  # noqa: B023
                      p.release, f"{system.name} {api} 4 KiB")  # noqa: B023
            lat = []
            for i in order:
                t = time.perf_counter()
                got = get(i)
                lat.append(time.perf_counter() - t)
                if not p.check(i, got):
                    raise RuntimeError(f"{system.name} {api}: 4 KiB entry {i} came back "
                                       "different")
                p.release(got)
                del got
            s = rec.get(system.name, api, "get_4k", size, gets)
            s.lat += lat
        if p.gets:
            p.clear()
            system.kept = 0


def rotate(xs: list[System], r: int) -> list[System]:
    return xs[r % len(xs):] + xs[:r % len(xs)] if xs else xs


def guarded(systems: list[System], failed: dict[str, str], fn: Callable[[System], None]) -> None:
    for s in systems:
        if s.name in failed:
            continue
        try:
            fn(s)
        except Exception as err:  # one system's failure must not lose the others' numbers
            failed[s.name] = f"{type(err).__name__}: {err}"
            print(f"!! {s.name} failed: {failed[s.name]}", flush=True)


def copy_seconds(kv: torch.Tensor, repeat: int) -> list[float]:
    """The limit: one single-threaded copy of the same bytes into a preallocated buffer."""
    src = kv.view(-1).view(torch.uint8).numpy()
    dst = np.empty_like(src)
    return timed(lambda: np.copyto(dst, src), repeat)


def measure(systems: list[System], sizes: list[tuple[int, int]], batch: int, gets: int,
            runs: int, failed: dict[str, str], fill: Fill) -> list[dict[str, Any]]:
    rec = Recorder()
    routes = 8  # the most put routes a system has (each run of each takes new keys)
    for size, count in sizes:
        kv = payload(size, seed=size)
        ser = rec.get("memcpy", "np.copyto", "copy", size, 1)
        ser.lat = copy_seconds(kv, 10)
        ser.gbs = [size / x / 1e9 for x in ser.lat]
        for s in systems:
            s.next_index, s.workload = 0, s.workload + 1
        guarded(systems, failed, lambda s: s.load(kv, count, count * runs * routes))  # noqa: B023
        for r in range(runs):
            guarded(rotate(systems, r), failed,
                    lambda s: one_run(s, rec, size, count, fill))  # noqa: B023
            print(f"{size // MIB} MiB run {r + 1}/{runs} done", flush=True)
        guarded(systems, failed, lambda s: s.unload())
    kv = payload(MIB, seed=1)
    for s in systems:
        s.next_index, s.workload = 0, s.workload + 1
    guarded(systems, failed, lambda s: s.load(kv, batch, batch * runs * routes * BATCH_CALLS))
    for r in range(runs):
        guarded(rotate(systems, r), failed, lambda s: batch_run(s, rec, MIB, batch, fill))
        print(f"batch run {r + 1}/{runs} done", flush=True)
    guarded(systems, failed, lambda s: s.unload())
    guarded(systems, failed, lambda s: s.routes()[0].clear())  # before the small entries
    kv = payload(4096, seed=2)
    for s in systems:
        s.next_index, s.kept, s.workload = 0, 0, s.workload + 1
    guarded(systems, failed, lambda s: s.load(kv, 1, (gets + 50) * routes))
    guarded(systems, failed, lambda s: latency_run(s, rec, gets, seed=3))
    guarded(systems, failed, lambda s: s.unload())
    return [x.row() for x in rec.series.values()]
