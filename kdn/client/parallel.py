"""One retrieve over several gRPC streams: contiguous layer groups read side by side.

A remote client (no shared segment) asks for layers [a, b) of the same entry on each of N
Retrieve streams (``RetrieveRequest.first_layer`` / ``last_layer``) and hands the frames of all
of them, as they arrive, to one ``LayerStream``. Each stream has its own channel (its own TCP
connection and HTTP/2 flow-control window), so one slow window does not hold the others back.
The first stream asks for the whole entry: only an entry large enough for the split to pay
(``GROUP_MIN_BYTES`` a stream) gets the others, once the first's header told its size, and the
first stops after its own group (``merged``'s ``stop``).

The N answers must name one stored version: an entry overwritten between the calls would
otherwise mix two versions, and two versions of one layout and length have the same container
header (frame checksums are seeded by it, so they would all pass). Each answer carries the
header and ``entry_digest`` (a hash of every frame's prefix, checksums included); when they
differ the caller reads again over one stream. A frame that two groups share (frames of
several layers straddling a boundary) is passed on once.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kdn.errors import kept

_DONE = object()
GROUP_MIN_BYTES = 32 << 20
"""Entry bytes per stream below which a retrieve is not split: smaller parts cost more in
per-stream overhead than the streams side by side gain."""


def stream_cores() -> int:
    """How many streams this process's cores can receive side by side: one per two cores it
    may run on (a stream's gRPC receive and its consumer each keep one busy): more streams
    than that only compete for the same cores."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, cores // 2)


def layer_groups(num_layers: int, n: int) -> list[tuple[int, int]]:
    """``n`` (or fewer) contiguous [first, last) ranges covering ``num_layers`` layers."""
    n = max(1, min(n, num_layers))
    bounds = [round(i * num_layers / n) for i in range(n + 1)]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]


def merged(calls: Sequence[Any], stop: int | None = None) -> Iterator[Any]:
    """The messages of every call as they arrive, each frame index once; the first error of
    any call is raised here (after which the others are drained by their own threads).
    ``stop``: the first call is cancelled once it brought a frame of this index or later
    (the later frames are the other calls' to bring)."""
    out: queue.Queue[Any] = queue.Queue()

    def pump(call: Any, last: int | None) -> None:
        try:
            for msg in call:
                out.put(msg)
                if last is not None and msg.frame.index >= last:
                    call.cancel()
                    break
        except BaseException as exc:  # handed to the consumer
            out.put(kept(exc))  # not this frame, which holds ``out``
        finally:
            out.put(_DONE)

    for j, call in enumerate(calls):
        threading.Thread(target=pump, args=(call, stop if j == 0 else None), daemon=True,
                         name="kdn-pstream").start()
    seen: set[int] = set()
    running = len(calls)
    while running:
        msg = out.get()
        if msg is _DONE:
            running -= 1
            continue
        if isinstance(msg, BaseException):
            try:
                raise msg
            finally:  # its traceback holds this frame
                del msg
        if msg.frame.index in seen:
            continue
        seen.add(msg.frame.index)
        yield msg
