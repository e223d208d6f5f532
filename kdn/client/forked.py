"""What a child of ``fork()`` keeps of the shared memory its parent's results view.

A ``retrieve`` on the server's host hands out tensors that view memory the server shares: the
client's segment (``kdn.client.shm.SharedSegment``, a ``MAP_SHARED`` memfd) or the server's
read arena (``kdn.client.shm.LeasedArena``, mapped copy-on-write: its untouched pages follow
the server's memfd). A child of ``fork()`` (a ``multiprocessing`` worker) inherits those
mappings as they are, so without more its copy of a result would change when the parent
reuses the region for another entry, or the server the arena's slot, and a child writing one
in place would change the parent's. So each segment and arena registers here (``track``), and
in a child an ``os.register_at_fork`` hook makes the pages of every region a view still shows
the child's own (``keep_pages``: a copy of those pages, paid once, in the child): what it
inherited stays the snapshot it was. Where that fails (a warning says so) the child must copy
what it keeps (``.clone()``) before the parent reads on.
"""

from __future__ import annotations

import logging
import mmap
import os
import weakref
from typing import Any, Protocol

import numpy as np

from kdn.transport.buffers import MADV_POPULATE_WRITE, own_pages

log = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE


class Inherited(Protocol):
    def make_private(self) -> bool:
        """Make the pages views of it show this process's own; False where some were not."""
        ...


_tracked: weakref.WeakSet[Any] = weakref.WeakSet()


def track(memory: Inherited) -> None:
    """Make ``memory``'s views private in a child of ``fork()`` (module docstring)."""
    _tracked.add(memory)


def keep_pages(mapping: mmap.mmap, ranges: list[tuple[int, int]], *, writable: bool,
               copy_on_write: bool) -> bool:
    """Make the pages of ``ranges`` (offset, length) of ``mapping`` this process's own, their
    bytes as they are now: a copy-on-write mapping's (``copy_on_write``, ``writable``) are
    copied on write at once (``MADV_POPULATE_WRITE``: what the process wrote stays), a shared
    mapping's are swapped for a copy (``own_pages``; read-only unless ``writable``). The cost,
    a copy of those pages, is paid once, here. False where some could not be."""
    runs: list[list[int]] = []  # [first page, end page) of the ranges, merged
    for first, end in sorted((offset // PAGE, (offset + length - 1) // PAGE + 1)
                             for offset, length in ranges):
        if runs and first <= runs[-1][1]:
            runs[-1][1] = max(runs[-1][1], end)
        else:
            runs.append([first, end])
    if not runs:
        return True
    base = np.frombuffer(mapping, dtype=np.uint8).ctypes.data
    done = True
    for first, end in runs:
        start, n = first * PAGE, (end - first) * PAGE
        if writable and copy_on_write:
            try:
                mapping.madvise(MADV_POPULATE_WRITE, start, n)
                continue
            except OSError:  # a kernel before 5.14: swapped for a copy as below
                pass
        done &= own_pages(base + start, n, writable=writable)
    return done


def _after_fork_in_child() -> None:
    for memory in list(_tracked):
        try:
            done = memory.make_private()
        except Exception as exc:  # noqa: BLE001 - a fork hook must not raise
            log.warning("kdn: shared memory not made private after fork(): %s", exc)
            done = True
        if not done:
            log.warning("kdn: some results inherited over fork() still view memory the "
                        "parent and the server reuse: clone() them before the parent reads on")


os.register_at_fork(after_in_child=_after_fork_in_child)
