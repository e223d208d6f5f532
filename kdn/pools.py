"""Thread pools kept for the life of a process: made on first use, and made again in a child
of ``fork()``.

    _POOL = SharedPool(4, "kdn-codec")
    records = list(_POOL.get().map(encode_one, layers))

A ``ThreadPoolExecutor`` kept in a module variable does not survive ``fork()``: the child
inherits the executor's record of its worker threads but not the threads, so whatever it
submits there waits forever (a ``multiprocessing`` worker's ``codec.encode`` hung). Every pool
kdn keeps beyond the life of one object is a ``SharedPool``; an ``os.register_at_fork`` hook
makes each forget its executor in the child (dropped, not shut down: its threads are the
parent's, not there to join), so the child's first ``get`` starts threads of its own. The
parent's pools are untouched. The same hook keeps the child's garbage collector off what it
inherited (``gc.freeze``): the parent's garbage holds gRPC objects that crash a child that
frees them.
"""

from __future__ import annotations

import gc
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor


class SharedPool:
    """A ``ThreadPoolExecutor`` of ``workers`` threads named ``name``-N, made by the first
    ``get`` in this process (module docstring). Thread-safe."""

    def __init__(self, workers: int, name: str) -> None:
        self.workers = workers
        self.name = name
        self._lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        _POOLS.add(self)

    def get(self) -> ThreadPoolExecutor:
        """The executor of this process (made now on the first call)."""
        executor = self._executor
        if executor is None:
            with self._lock:
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.workers,
                                                        thread_name_prefix=self.name)
                executor = self._executor
        return executor

    def _forget(self) -> None:
        """In a fork child: the executor and lock are the parent's (a thread of the parent may
        have held the lock at the fork)."""
        self._lock = threading.Lock()
        self._executor = None


_POOLS: weakref.WeakSet[SharedPool] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # What the child inherited is the parent's, garbage included: reference cycles of a
    # closed Client hold gRPC objects whose deallocation crashes a fork child (SIGSEGV under
    # the child's first collection: a multiprocessing worker's codec.encode died and its
    # Pool waited forever). The child's collector leaves them be (the memory stays shared).
    gc.freeze()
    for pool in list(_POOLS):
        pool._forget()


os.register_at_fork(after_in_child=_after_fork_in_child)
