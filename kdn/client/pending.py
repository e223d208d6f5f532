"""``PendingStore``: the handle ``Client.store_async`` gives back, answered later by the data
path that sent the store (``kdn.client.samehost`` or ``kdn.client.netpath``), which reads the
answers on the sending thread's connection in order and hands each to its store (``resolve``).

A store holds its path weakly: the path's unanswered stores are kept where its thread's
connection is (``kdn.client.perthread``), whose finalizer outlives the path, and a store that
held the path would keep a client dropped without ``close()`` (its segment, its connections)
for as long as its thread lives. A store whose client is gone by then fails UNAVAILABLE.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from kdn.client.fastwire import fast_error, put_results
from kdn.errors import Corrupt, InvalidArgument, KDNError, Unavailable, again, kept
from kdn.v1 import kdn_pb2 as pb

log = logging.getLogger(__name__)

ASYNC_DEPTH = 8
"""Asynchronous stores a thread has sent and not had answered; past it each new one first
reads the oldest answer."""

Sent = tuple["PendingStore", "tuple[int, int] | None", Any]
"""An asynchronous store sent on a same-host path and not answered yet: its ``PendingStore``,
the segment's region its bytes were written into (freed when answered) or None, and the staged
entry it names (``kdn.client.staged.InFlight``: its region kept until answered) or None."""


class PendingStore:
    """What ``Client.store_async`` gives back: ``result()`` waits for the server's answer and
    raises its error; ``done()`` says whether it came. Answers are read on the thread that
    stored (its fast-path connection answers in order): ``result()`` on another thread works
    once that thread's next call or ``flush`` has read it."""

    __slots__ = ("key", "_path", "_thread", "_on_done", "_response", "_error", "_done")

    def __init__(self, path: Any, key: bytes,
                 on_done: Callable[[bool], object] | None = None) -> None:
        """``path``: the data path that sent it (its ``settle(until)`` reads the answer);
        ``on_done``: called once with whether it was stored, when it is answered or fails."""
        self.key, self._on_done = key, on_done
        self._path = weakref.ref(path) if path is not None else None  # (module docstring)
        self._thread = threading.get_ident()
        self._response: pb.StoreResponse | None = None
        self._error: KDNError | None = None
        self._done = False

    @classmethod
    def answered(cls, key: bytes, response: pb.StoreResponse) -> PendingStore:
        """One stored synchronously (no way to send it ahead)."""
        p = cls(None, key)
        p._response, p._done = response, True
        return p

    @classmethod
    def failed(cls, key: bytes, error: KDNError) -> PendingStore:
        """One stored synchronously that failed with ``error``."""
        p = cls(None, key)
        p.resolve(None, error)
        return p

    def done(self) -> bool:
        return self._done

    def result(self) -> pb.StoreResponse:
        if not self._done:
            if threading.get_ident() != self._thread:
                raise InvalidArgument("an asynchronous store is answered on the thread that "
                                      "sent it: read result() there, or after its flush()")
            path = self._path() if self._path is not None else None
            if path is not None:
                path.settle(self)
        if not self._done:  # its connection is gone and nothing holds its answer any more
            self.resolve(None, Unavailable(f"the store of {self.key!r} was not answered; it "
                                           "may or may not be stored"))
        if self._error is not None:
            raise again(self._error)  # a copy: its traceback holds the frames that hold this
        assert self._response is not None
        return self._response

    def answer(self, ok: int, body: bytes) -> KDNError | None:
        """Resolve with the answer to its one-item PutMany (``ok``, ``body``: ``kdn.client.
        fastwire.fast_answer``'s); its error where it failed."""
        error = None if ok else fast_error(body)
        if error is None:
            try:
                response = put_results(body, 1)[0]
            except Corrupt as exc:
                error = exc
            else:
                self.resolve(response, None)
                return None
        self.resolve(None, error)
        return error

    def resolve(self, response: pb.StoreResponse | None, error: KDNError | None) -> None:
        """The server's answer came (``response``), or the store failed (``error``). Done
        last: another thread that sees ``done()`` reads both."""
        self._response = response
        self._error = kept(error) if error is not None else None  # not the frames it came by
        self._done = True
        on_done, self._on_done = self._on_done, None
        if on_done is not None:
            try:  # keeping a copy in the in-process tier: a later call reads this answer,
                on_done(error is None)  # and must not fail for it
            except Exception as exc:  # noqa: BLE001
                log.warning("kdn: the in-process tier did not keep %r: %s", self.key, exc)


class Refused(threading.local):
    """The errors of a thread's ``store_async`` calls stored as ``store`` (no path to send
    them ahead) since its last ``flush``, which raises them as it raises the others'."""

    def __init__(self) -> None:
        self.errors: list[KDNError] = []
