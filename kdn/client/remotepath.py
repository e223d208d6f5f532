"""The network data path as a client's data plane holds it (``RemotePath``): asked for once
(``Attach`` with ``remote``, for a client without a segment), its calls made on this thread's
``kdn.client.netpath.NetPath`` connection, given up for gRPC when it fails, asked for again
once where it worked before (a server restart), a call the server refused a new connection
for sent by gRPC (``kdn.client.perthread.Crowded``). A call that goes this way has one
deadline (``one_deadline``) for the path asked for again, the call made again and the gRPC
call after it failed: a path that breaks costs no call more than its ``timeout_s``."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from kdn.client.deadline import deadline_within, own_cap, time_left
from kdn.client.fastwire import batches_of
from kdn.client.netpath import NetPath
from kdn.client.pending import ASYNC_DEPTH, PendingStore
from kdn.client.perthread import Crowded
from kdn.client.received import Fetched, fetched
from kdn.client.rpc import CLOSED
from kdn.codec import EncodedParts
from kdn.errors import Closed, DeadlineExceeded, KDNError, NotFound, Unavailable, kept
from kdn.layout import Expected
from kdn.v1 import kdn_pb2 as pb

log = logging.getLogger(__name__)
T = TypeVar("T")


class RemotePath:
    """The network data path as the data plane holds it: asked for once (``Attach`` with
    ``remote``, for a client without a segment), given up for good when it fails (gRPC from
    then on), unless it worked before: then asked for again once, as after a server restart
    (``_again``). ``call``/``metadata``: the client's retrying call and call metadata; ``host``:
    the server's host ("" for none); ``tls``: (ssl context, server name) when the channel
    speaks TLS."""

    def __init__(self, stub: Any, call: Callable[[Callable[[], Any]], Any],
                 metadata: Callable[[str | None], Any], timeout_s: float | None, host: str,
                 tls: Any = None, connections: int = 0) -> None:
        self._stub = stub
        self.connections = connections
        """``NetPath.connections`` of the paths asked for."""
        self._call = call
        self._metadata = metadata
        self.timeout_s = timeout_s
        self._host = host
        self._tls = tls
        self._lock = threading.Lock()
        self._net: NetPath | None = None
        self._tried = not host
        self._local = threading.local()  # the path holding this thread's unanswered stores
        self._closed: NetPath | None = None  # kept: a thread's answers come as it ends

    def path(self) -> NetPath | None:
        """The network data path, where the server offers one (asked once); None otherwise."""
        if self._tried:
            return self._net
        with self._lock:
            if not self._tried:
                self._net = self._ask()  # a server that can not be reached now raises: asked
                self._tried = True  # again by the next call
        return self._net

    def one_deadline(self) -> contextlib.AbstractContextManager[None]:
        """``deadline_within(timeout_s)`` for a call that may go by this path (it is there, or
        not asked for yet): what it makes after the path failed (asks for it again, the call
        again, by gRPC) ends by the call's first deadline, not a fresh one each. Nothing where
        there is no path or no timeout."""
        if self.timeout_s is None or (self._tried and self._net is None):
            return contextlib.nullcontext()
        return deadline_within(self.timeout_s, own=True)

    def _ask(self) -> NetPath | None:
        """``Attach`` with ``remote``: the path, or None where the server offers none."""
        md = self._metadata(None)
        try:
            resp = self._call(lambda: self._stub.Attach(
                pb.AttachRequest(remote=True), timeout=time_left(self.timeout_s), metadata=md))
        except (Unavailable, DeadlineExceeded):
            raise
        except KDNError as exc:  # no data path there, or an older server
            log.info("kdn: no network data path (%s); using gRPC", exc)
            return None
        if not resp.data_port:
            return None
        tls, name = self._tls or (None, "")
        return NetPath(self._host, resp.data_port, resp.segment_id, self.timeout_s, tls, name,
                       self.connections)

    def _again(self, net: NetPath, exc: Exception) -> NetPath | None:
        """``net`` failed after it had worked: the server may have restarted (another port,
        its tickets forgotten). Ask for the path again, once whichever threads saw it; the
        new path, or None where there is none (gRPC then). Unavailable where the server can
        not be reached (the next call asks again)."""
        with self._lock:
            if self._net is not net:
                return self._net  # asked for again by another thread, or given up
            log.info("kdn: network data path failed (%s); asking for it again", exc)
            self._net, self._tried = None, False
            net.close()
            self._net = self._ask()
            self._tried = True
            return self._net

    def _on(self, net: NetPath, call: Callable[[NetPath], T]) -> T | None:
        """``call(net)``, made once more on the path asked for again where ``net`` had worked
        and failed (``_again``); None where the path failed for good (gRPC then).
        DeadlineExceeded where the server did not answer in ``timeout_s``: one deadline per
        call, neither asked for again nor made again over gRPC; a path that never answered
        at all (a port that takes connections and says nothing) in the client's own
        ``timeout_s`` is given up then (not where a caller's sooner deadline ended the call),
        later calls go by gRPC. None too where the server refused this call's new connection
        (``Crowded``: its connection limits); the path stays for later calls."""
        try:
            return call(net)
        except Crowded as exc:
            log.debug("kdn: data path connection refused (%s); this call goes by gRPC", exc)
            return None
        except TimeoutError as exc:  # given up where it never answered in the client's own
            if not net.worked and own_cap():  # timeout_s, not a caller's shorter deadline
                self.lost(exc, net)
            raise _late(net) from exc
        except (OSError, NotFound) as exc:
            if not net.worked:
                self.lost(exc, net)
                return None
            again = self._again(net, exc)
        if again is None:
            return None
        try:
            return call(again)
        except Crowded:
            return None
        except TimeoutError as exc:  # the call's deadline spent before the path failed:
            raise _late(again) from exc  # the new path is not judged by what was left
        except (OSError, NotFound) as exc:
            self.lost(exc, again)
            return None

    def reconsider(self) -> None:
        """Ask for the path at the next call (the client has lost its shared segment)."""
        with self._lock:
            if self._net is None:
                self._tried = not self._host

    @property
    def decided(self) -> bool:
        """Whether the path was asked for already (or is known not to be wanted)."""
        return self._tried

    def skip(self) -> None:
        """Never ask for the path (the client has a shared segment)."""
        self._tried = True

    def lost(self, exc: Exception, net: NetPath) -> None:
        """The path ``net`` failed (no connection, or the server forgot the ticket): gRPC
        from now on (unless another thread has asked for the path again meanwhile)."""
        with self._lock:
            if self._net is not net:
                return
            log.warning("kdn: network data path unusable (%s); using gRPC", exc)
            self._net = None
        net.close()

    def get_many(self, net: NetPath, namespace: str, keys: Sequence[bytes],
                 want: Expected, pinned: bool = False) -> list[Fetched | None] | None:
        """``DataPlane.get_many`` on ``net``; None when it failed (gRPC then). ``pinned``:
        bound for a CUDA device (landed in page-locked memory)."""
        got = self._on(net, lambda n: n.get_many(namespace, keys, want,
                                                 pinned=pinned))
        if got is None:
            return None
        return [None if g is None else fetched(g[0], g[1], owned=True, checked=True,
                                               pinned=pinned)
                for g in got]

    def start_get_many(self, net: NetPath, namespace: str, keys: Sequence[bytes],
                       want: Expected, pinned: bool = False
                       ) -> list[tuple[str, Future[Fetched]] | None] | None:
        """``NetPath.start_get_many`` on ``net``, each entry's bytes as a Fetched (checked
        as they landed); None when the path failed (the caller reads another way)."""
        with self.one_deadline():
            got = self._on(net, lambda n: n.start_get_many(namespace, keys, want,
                                                           pinned=pinned))
        if got is None:
            return None
        out: list[tuple[str, Future[Fetched]] | None] = []
        for g in got:
            if g is None:
                out.append(None)
                continue
            tier, bytes_of = g
            entry: Future[Fetched] = Future()
            bytes_of.add_done_callback(functools.partial(_as_fetched, entry, tier, pinned))
            # weakly: each future keeping the other's callback would be a cycle, and the
            # entry's buffer (recycled once nothing refers to it) would wait for the garbage
            # collector while every later hit took fresh memory (the path holds ``bytes_of``
            # until it is done)
            entry.add_done_callback(functools.partial(_let_go, weakref.ref(bytes_of)))
            out.append((tier, entry))
        return out

    def put_many(self, net: NetPath, namespace: str,
                 items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]],
                 out: list[Any], limit: int) -> bool:
        """``DataPlane.put_many`` on ``net``, in calls of up to ``limit`` bytes (larger items
        stay as they are in ``out``); False when the path failed (the items not stored:
        gRPC)."""
        batches = batches_of(items, limit)

        def put(on: NetPath) -> bool:
            for batch in batches:
                for j, r in zip(batch, on.put_many(namespace, [items[j] for j in batch])):
                    out[j] = r
            return True

        return self._on(net, put) is not None

    # -- asynchronous stores (``Client.store_async`` of a client without a segment) -------------

    def put_async(self, namespace: str, key: bytes, opts: pb.StoreOptions,
                  parts: EncodedParts, on_done: Any = None) -> PendingStore | None:
        """The store sent on this thread's connection without waiting (it answers in order).
        None where there is no path, it failed, or this thread has no connection open yet
        (the caller stores it as ``store`` does, which opens one)."""
        net = self.path()
        if net is None:
            return None
        pending = PendingStore(self, key, on_done)
        sent = net.put_async(namespace, key, parts, opts, pending, ASYNC_DEPTH)
        if sent is False:
            failed = OSError("the data path connection failed")
            again = self._again(net, failed) if net.worked else None
            if again is None:
                self.lost(failed, net)
        if not sent:  # stored as ``store`` does (on a path asked for again too: this thread
            return None  # has no connection on it yet)
        old = getattr(self._local, "net", None)
        if old is not None and old is not net and old.has_pending():
            old.settle()  # a path before a restart: its answers first (or their failures)
        self._local.net = net  # kept: its unanswered stores are read through it
        return pending

    def has_pending(self) -> bool:
        net = getattr(self._local, "net", None)
        return net is not None and net.has_pending()

    def settle(self, until: PendingStore | None = None) -> None:
        """Read this thread's unanswered stores' answers, oldest first (up to ``until``)."""
        net = getattr(self._local, "net", None)
        if net is not None:
            net.settle(until)

    def take_failed(self) -> list[KDNError]:
        net = getattr(self._local, "net", None)
        return net.take_failed() if net is not None else []

    def close(self) -> None:
        """Close the connections and give the ticket back (``Detach``)."""
        net, self._net, self._tried = self._net, None, True
        if net is None:
            return
        net.close(Closed(CLOSED))  # (an entry still landing: cut short by the client's close)
        self._closed = net  # (its threads' stores: read as each ends, ``kdn.client.perthread``)
        try:
            md = self._metadata(None)
            self._call(lambda: self._stub.Detach(pb.DetachRequest(segment_id=net.ticket),
                                                 timeout=time_left(self.timeout_s),
                                                 metadata=md))
        except KDNError:
            pass  # the server forgets it at shutdown anyway


def _late(net: NetPath) -> DeadlineExceeded:
    return DeadlineExceeded(f"the network data path did not answer within the call's "
                            f"deadline (timeout_s={net.timeout_s}, or the caller's "
                            "deadline_within)")


def _let_go(bytes_of: weakref.ref[Future[memoryview]], entry: Future[Fetched]) -> None:
    """An entry cancelled by its reader: its bytes are not landed (``NetPath``)."""
    landing = bytes_of()
    if entry.cancelled() and landing is not None:
        landing.cancel()


def _as_fetched(entry: Future[Fetched], tier: str, pinned: bool,
                bytes_of: Future[memoryview]) -> None:
    if entry.done():  # cancelled by its reader
        return
    if bytes_of.cancelled():
        entry.cancel()
        return
    exc = bytes_of.exception()
    if exc is not None:
        entry.set_exception(exc)
        return
    try:
        entry.set_result(fetched(bytes_of.result(), tier, owned=True, checked=True,
                                 pinned=pinned))
    except BaseException as err:  # a header that does not parse: the entry's error
        entry.set_exception(kept(err))  # its traceback holds this frame, which holds ``entry``
