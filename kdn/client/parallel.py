"""One retrieve over several gRPC streams: contiguous layer groups read side by side.

A remote client (no shared segment) asks for layers [a, b) of the same entry on each of N
Retrieve streams (``RetrieveRequest.first_layer`` / ``last_layer``) and hands the frames of all
of them, as they arrive, to one ``LayerStream``. Each stream has its own channel (its own TCP
connection and HTTP/2 flow-control window), so one slow window does not hold the others back.

The N answers must name one stored version: an entry overwritten between the calls would
otherwise mix two versions, and two versions of one layout and length have the same container
header (frame checksums are seeded by it, so they would all pass). Each answer carries the
header and ``entry_digest`` (a hash of every frame's prefix, checksums included); when they
differ the caller reads again over one stream. A frame that two groups share (frames of
several layers straddling a boundary) is passed on once.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

_DONE = object()


def layer_groups(num_layers: int, n: int) -> list[tuple[int, int]]:
    """``n`` (or fewer) contiguous [first, last) ranges covering ``num_layers`` layers."""
    n = max(1, min(n, num_layers))
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def merged(calls: Sequence[Iterator[Any]]) -> Iterator[Any]:
    """The messages of every call as they arrive, each frame index once; the first error of
    any call is raised here (after which the others are drained by their own threads)."""
    out: queue.Queue[Any] = queue.Queue()

    def pump(call: Iterator[Any]) -> None:
        try:
            for msg in call:
                out.put(msg)
        except BaseException as exc:  # handed to the consumer
            out.put(exc)
        finally:
            out.put(_DONE)

    for call in calls:
        threading.Thread(target=pump, args=(call,), daemon=True, name="kdn-pstream").start()
    seen: set[int] = set()
    running = len(calls)
    while running:
        msg = out.get()
        if msg is _DONE:
            running -= 1
            continue
        if isinstance(msg, BaseException):
            raise msg
        if msg.frame.index in seen:
            continue
        seen.add(msg.frame.index)
        yield msg
