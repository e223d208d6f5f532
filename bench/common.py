"""Shared plumbing for benchmarks: timing, a printed table, JSON results with machine facts."""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from kdn.transport.buffers import allocator_tuned


def machine() -> dict[str, Any]:
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        # the thresholds kdn's Client sets (kdn.transport.buffers)
        "malloc_tuned": allocator_tuned(),
    }


def timed(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Wall seconds of ``repeat`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def percentile(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def print_table(rows: list[dict[str, Any]], cols: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(x[i]) for x in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for x in cells:
        print("  ".join(v.rjust(w) for v, w in zip(x, widths)))


def write_json(path: Path | str, name: str, rows: list[dict[str, Any]], **extra: Any) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"benchmark": name, "machine": machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                          time.gmtime()),
           **extra, "rows": rows}
    path.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {path}")


def arg_parser(doc: str | None, name: str, quick_help: str | None = None
               ) -> argparse.ArgumentParser:
    """The options every benchmark takes: ``--quick`` for a smoke run and ``--out`` for its JSON
    results (``bench/results/<name>.json``); ``doc``, the module docstring, is the help text."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--out", type=Path, default=Path(f"bench/results/{name}.json"))
    return ap


def positive_int(text: str) -> int:
    """An argparse ``type=`` for a whole number >= 1 (a count of cases, say)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def number_list(kind: Callable[[str], float], least: float = 0.0, above: bool = True
                ) -> Callable[[str], list[Any]]:
    """An argparse ``type=`` for a comma-separated list of ``kind`` (int or float) numbers, each
    above ``least`` (``above=False``: at least ``least``); a bad one is a usage error naming it
    (empty: an empty list, the default)."""
    def parse(text: str) -> list[Any]:
        out = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            try:
                x = kind(part)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"{part!r} is not {'a whole number' if kind is int else 'a number'}"
                ) from None
            if x != x or (x <= least if above else x < least):
                raise argparse.ArgumentTypeError(
                    f"{part!r} must be {'above' if above else 'at least'} {least:g}")
            out.append(x)
        return out

    return parse


def figure(width: float = 7.0, height: float = 4.5, ncols: int = 1) -> tuple[Any, Any]:
    """A headless matplotlib figure and its axes, ``ncols`` side by side (Agg backend; nothing
    needs a display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=(width, height))


def save_figure(fig: Any, path: Path, dpi: int = 110) -> None:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    print(f"wrote {path}")


# -- server processes ------------------------------------------------------------------------

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def wait_until(ready: Callable[[], bool], what: str, proc: subprocess.Popen[bytes] | None = None,
               timeout_s: float = 60.0) -> None:
    """Poll ``ready`` (a real probe, not a sleep) until it holds; fail if ``proc`` exits."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        try:
            if ready():
                return
        except Exception:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not ready after {timeout_s:.0f} s")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((HOST, port)) == 0


@contextmanager
def kdn_server(data_dir: Path, *options: str, wait_s: float = 60.0) -> Iterator[str]:
    """``kdn serve`` as a process of its own on a free loopback port, RAM only by default
    (``--disk-bytes 0``; ``options`` are further ``kdn serve`` flags, later ones win), its log
    beside ``data_dir``; its address once it answers SERVING."""
    from kdn.client import Client

    port = free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    with process([sys.executable, "-m", "kdn", "serve", "--host", HOST, "--port", str(port),
                  "--data-dir", str(data_dir), "--disk-bytes", "0", "--log-level", "WARNING",
                  *options], data_dir.with_name(f"{data_dir.name}-server.log")) as proc:
        address = f"{HOST}:{port}"
        with Client(address, timeout_s=2) as probe:
            wait_until(lambda: probe.health() == "SERVING", "kdn server", proc, wait_s)
        yield address


@contextmanager
def process(cmd: list[str], log: Path, env: dict[str, str] | None = None
            ) -> Iterator[subprocess.Popen[bytes]]:
    """A server process logging to ``log``, stopped (terminate, then kill) on exit."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        yield proc
    finally:
        stop(proc)


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Terminate ``proc`` if it still runs; kill it when it has not exited 10 s later."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
