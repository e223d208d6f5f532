"""Egress rate limits: the bytes per second the server sends to clients, per connection and
per tenant (an operator's cap; benchmarks emulate 1/10/25/100 Gbit/s links with it on loopback).

Two caps, both in bytes/s, 0 = unlimited: ``ServerConfig.egress_bytes_per_s`` for each client
connection, and a tenant's ``egress_bytes_per_s`` in the tenants file, shared by all of that
tenant's connections. Each is a token bucket; a send takes its bytes from both (the stricter
cap sets the pace). A bucket holds at most ``BURST_BYTES`` (or 1 ms of its rate, if less),
so the bytes leave smoothly rather than in bursts, and a read after an idle spell comes at
most 1 ms sooner than the rate says (an emulated link stays true for hits of a few MB). A
gRPC message is paced whole (a frame, up to ``max_message_bytes``): its wait comes before it,
then it leaves at once.

Who paces: the gRPC reads (Retrieve, RetrieveMany, Blend and the admin's Export each message
before it is yielded, an inline GetMany its whole answer before it returns) and the network
data path (its GetMany's entries, sent in slices of at most a burst). The same-host path moves
no bytes over a link (entries are copied into the client's segment or leased from the arena)
and is not paced.

Lifecycle: the servicer holds one ``Egress``; a read asks it for a ``Pacer`` (None when neither
cap applies: an unlimited server pays one attribute test per call, nothing per byte), and calls
``pace`` (threads) or ``apace`` (the event loop) with each piece's size before sending it.
Bytes that then do not leave are given back (``refund``): a call cancelled while ``apace``
waits (its deadline passed, its client went away), a data-path send that fails; so a read cut
short holds back none of the tenant's later reads, and only bytes sent count as delayed.
Connections are named by their peer address; their buckets are kept for the last
``MAX_CONNECTIONS`` connections seen (a forgotten one starts again with a full bucket).
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

from kdn.transport.wire import send_pieces

BURST_BYTES = 4 << 20
"""Most bytes a bucket holds: about one frame may leave at once."""
MAX_CONNECTIONS = 4096
"""Connections whose buckets are remembered."""


class Bucket:
    """A token bucket of ``rate`` bytes/s that lends: ``reserve`` takes the bytes at once (the
    level may go below zero) and says how long to wait before sending them."""

    def __init__(self, rate: int) -> None:
        self.rate = float(rate)
        self.capacity = float(max(1, min(BURST_BYTES, rate // 1000)))
        self.level, self.stamp = self.capacity, time.monotonic()
        self._lock = threading.Lock()

    def reserve(self, n: int) -> float:
        """Seconds until ``n`` bytes taken now may leave."""
        with self._lock:
            now = time.monotonic()
            self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate) - n
            self.stamp = now
            return -self.level / self.rate if self.level < 0 else 0.0

    def refund(self, n: int) -> None:
        """Give back ``n`` bytes taken by ``reserve`` that will not leave (their read ended
        while it waited), so later reads do not wait for them."""
        with self._lock:
            self.level = min(self.capacity, self.level + n)


class Pacer:
    """One read's pacing: the buckets that apply to it (its connection's, its tenant's)."""

    def __init__(self, egress: Egress, tenant: str, buckets: tuple[Bucket, ...]) -> None:
        self._egress, self._tenant, self._buckets = egress, tenant, buckets
        self.slice = int(min(b.capacity for b in buckets))
        """The largest piece to send in one go."""

    def _delay(self, n: int) -> float:
        return max(b.reserve(n) for b in self._buckets)

    def refund(self, n: int) -> None:
        """Give ``n`` paced bytes that will not be sent back to every bucket."""
        for b in self._buckets:
            b.refund(n)

    def pace(self, n: int) -> None:
        """Wait (this thread) until ``n`` more bytes may leave; if they then cannot be sent,
        the caller ``refund``s them."""
        wait = self._delay(n)
        if wait > 0:
            time.sleep(wait)
            self._egress.delayed(self._tenant, n, wait)

    async def apace(self, n: int) -> None:
        """Wait (the event loop) until ``n`` more bytes may leave. A call cancelled while it
        waits (its deadline, its client gone) sends none of them: they are refunded, counted
        as ``egress.cancelled``, and not counted as delayed."""
        wait = self._delay(n)
        if wait > 0:
            try:
                await asyncio.sleep(wait)
            except asyncio.CancelledError:
                self.refund(n)
                self._egress.cancelled(self._tenant, n)
                raise
            self._egress.delayed(self._tenant, n, wait)

    def send(self, conn: socket.socket, pieces: Sequence[bytes | memoryview]) -> None:
        """Send ``pieces`` on ``conn`` in order, in slices of at most ``slice`` bytes, each
        once the buckets allow it."""
        batch: list[memoryview] = []
        size = 0
        for piece in pieces:
            view = memoryview(piece).cast("B")
            while len(view):
                part = view[: self.slice - size]
                batch.append(part)
                size += len(part)
                view = view[len(part):]
                if size >= self.slice:
                    self._send(conn, batch, size)
                    batch, size = [], 0
        if batch:
            self._send(conn, batch, size)

    def _send(self, conn: socket.socket, batch: list[memoryview], size: int) -> None:
        self.pace(size)
        try:
            send_pieces(conn, batch)
        except OSError:  # the connection is gone: these bytes did not leave
            self.refund(size)
            raise


class Egress:
    """The server's egress caps (module docstring); ``on`` is False when there are none.
    ``delayed`` is called with what waited and was then sent (``kdn.server.usage.Usage.paced``),
    ``cancelled`` with what a call ended while it waited (``Usage.pace_cancelled``)."""

    def __init__(self, connection_rate: int, tenant_rates: Mapping[str, int],
                 delayed: Callable[[str, int, float], None],
                 cancelled: Callable[[str, int], None] = lambda tenant, n: None) -> None:
        self.connection_rate = connection_rate
        self._tenants = {t: Bucket(r) for t, r in tenant_rates.items() if r > 0}
        self.on = bool(connection_rate or self._tenants)
        self.delayed, self.cancelled = delayed, cancelled
        self._connections: OrderedDict[str, Bucket] = OrderedDict()
        self._lock = threading.Lock()

    def pacer(self, tenant: str, connection: str) -> Pacer | None:
        """The pacing of a read by ``tenant`` on the connection named ``connection`` (its
        peer address); None when no cap applies to it."""
        if not self.on:
            return None
        buckets: list[Bucket] = []
        if self.connection_rate:
            with self._lock:
                bucket = self._connections.get(connection)
                if bucket is None:
                    bucket = self._connections[connection] = Bucket(self.connection_rate)
                    while len(self._connections) > MAX_CONNECTIONS:
                        self._connections.popitem(last=False)
                else:
                    self._connections.move_to_end(connection)
            buckets.append(bucket)
        if tenant in self._tenants:
            buckets.append(self._tenants[tenant])
        return Pacer(self, tenant, tuple(buckets)) if buckets else None
