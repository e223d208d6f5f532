"""Group commit for the disk tier: writes that threads make at once share one transaction.

An LMDB environment has one writer at a time, and a committed transaction with ``sync`` costs
the disk its flushes (the pages, then the meta page), so each small write-through store paid
two flushes of its own, waiting in turn behind every other writer's.

Lifecycle: ``LmdbTier`` builds one ``GroupCommit(transact)``, and each of its writes (a body:
a function of a write transaction, and the bytes it adds) calls ``submit(body, need)`` from
its own thread. A writer that finds no group running leads one: it takes the writes queued
so far (its own among them, at most ``GROUP_BYTES`` unless one alone is more) and commits
them with one ``transact(run, need)`` call (``LmdbTier._transact``: one write transaction,
retried in a grown map where it was full), while writers that come meanwhile queue for the
next group. Each writer waits until its own write is settled, then returns its body's result
or raises its body's error. A write with none queued beside it runs in the transaction itself,
as it would without grouping.

Guarantees (``kdn.store.lmdb``'s crash safety holds for each write): ``submit`` returns only
once the transaction holding the write is committed; each body of a group runs in a
transaction nested in the group's (``begin(write=True, parent=txn)``), so a body that fails
(too large, no room among pinned entries, an LMDB error) is rolled back and fails alone, and
the others commit. A group that fails as a whole (its commit failed: the disk full, an I/O
error; the map full at its maximum; the tier closed) commits nothing, and each of its writes
is run again in a transaction of its own, so each lands or fails on its own (a map full at
its maximum is reported by those, once each, not by the group's try: ``transact``'s ``quiet``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from functools import partial

import lmdb

from kdn.errors import TierUnavailable

GROUP_BYTES = 32 << 20
"""Most bytes one group takes (a write of more is a group of its own): LMDB holds a
transaction's dirty pages in memory, up to a limit, until its commit."""

Body = Callable[[lmdb.Transaction], int | None]
Run = Callable[[lmdb.Environment, lmdb.Transaction], None]


class _Write:
    """One queued write: its body, the bytes it adds, and once run its result or error."""

    __slots__ = ("body", "need", "done", "error", "committed", "settled")

    def __init__(self, body: Body, need: int) -> None:
        self.body = body
        self.need = need
        self.done = 0
        self.error: Exception | None = None
        self.committed = False  # its transaction committed: it stands, whatever comes after
        self.settled = False  # set under the condition once its transaction is over


def _alone(w: _Write, env: lmdb.Environment, txn: lmdb.Transaction) -> None:
    w.error = None
    w.done = w.body(txn) or 0


def _nested(group: list[_Write], env: lmdb.Environment, txn: lmdb.Transaction) -> None:
    """Each write of ``group`` in a transaction nested in ``txn``: one that fails is rolled
    back alone, its error kept; a full map fails them all (``transact`` grows it and runs
    the group again)."""
    for w in group:
        w.error = None
        try:
            with env.begin(write=True, parent=txn) as child:
                w.done = w.body(child) or 0
        except lmdb.MapFullError:
            raise
        except Exception as exc:
            w.error = exc


class GroupCommit:
    """Writes of many threads committed in shared transactions (the module docstring)."""

    def __init__(self, transact: Callable[[Run, int, bool], None]) -> None:
        self._transact = transact
        self._cond = threading.Condition()
        self._queue: deque[_Write] = deque()
        self._leading = False

    @property
    def queued(self) -> int:
        """Writes waiting for a group (not yet taken by a leader)."""
        return len(self._queue)

    def submit(self, body: Body, need: int) -> int:
        """``body``'s result once the transaction it ran in is committed; its error if it
        failed (or the transaction did)."""
        w = _Write(body, need)
        with self._cond:
            self._queue.append(w)
            while not w.settled:
                if self._leading:
                    self._cond.wait()
                    continue
                group = self._take()
                self._leading = True
                self._cond.release()
                try:
                    self._commit(group)
                except BaseException as exc:  # (an interrupt): no writer left waiting
                    for g in group:
                        if not g.committed and g.error is None:
                            g.error = TierUnavailable(f"disk tier write abandoned: {exc!r}")
                    raise
                finally:
                    self._cond.acquire()
                    for g in group:
                        g.settled = True
                    self._leading = False
                    self._cond.notify_all()
        if w.error is not None:
            raise w.error
        return w.done

    def _take(self) -> list[_Write]:
        group = [self._queue.popleft()]
        total = group[0].need
        while self._queue and total + self._queue[0].need <= GROUP_BYTES:
            total += self._queue[0].need
            group.append(self._queue.popleft())
        return group

    def _commit(self, group: list[_Write]) -> None:
        if len(group) > 1:
            try:
                self._transact(partial(_nested, group), sum(w.need for w in group), True)
                for w in group:
                    w.committed = w.error is None
                return
            except Exception:  # nothing committed: each on its own (module docstring)
                pass
        for w in group:
            try:
                self._transact(partial(_alone, w), w.need, False)
                w.committed = True
            except Exception as exc:
                w.error = exc
