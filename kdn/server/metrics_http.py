"""The Prometheus ``/metrics`` endpoint over HTTP, bounded as the gRPC port is.

Lifecycle: ``Metrics.serve_http`` (``kdn.server.observe``) starts a ``MetricsHTTPServer`` on its
own thread; ``Metrics.close`` shuts it down. Each connection is served on a thread of its own
(prometheus_client's WSGI app renders the registry), and:

- at most ``MAX_CONNECTIONS`` are served at once; one past that is closed as it is accepted;
- a request must arrive whole (request line and headers) within ``request_s`` of the
  connection's opening (the server's ``handshake_timeout_s``), else the connection is closed:
  the serving loop checks every half second, so a client that trickles its request holds a
  thread no longer than that;
- every read and write of the socket is bounded by ``request_s`` too.

prometheus_client's own ``start_http_server`` had neither bound: connections that never finished
their request stayed open for ever, a thread each (300 of them held 300 threads).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 16
"""Connections served at once (a few scrapers need a few); one more is closed unserved."""


class _Handler(WSGIRequestHandler):
    """One request per connection, logged nowhere (a scrape every few seconds)."""

    server: MetricsHTTPServer

    def parse_request(self) -> bool:
        ok = super().parse_request()  # the request line and headers are read by now
        self.server.whole(self.connection)
        return ok

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  # (the base's name)
        pass


class MetricsHTTPServer(ThreadingMixIn, WSGIServer):
    """``registry`` at ``/metrics`` on ``(host, port)``, bounded as the module docstring says."""

    daemon_threads = True

    def __init__(self, host: str, port: int, registry: CollectorRegistry, *,
                 request_s: float, max_connections: int = MAX_CONNECTIONS) -> None:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                   flags=socket.AI_PASSIVE)[0]
        self.address_family = family
        self.request_s = request_s
        self.refused = 0  # connections closed unserved: past ``max_connections``
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._pending: dict[socket.socket, float] = {}  # request not yet whole -> deadline
        super().__init__((str(addr[0]), int(addr[1])), _Handler)
        self.set_app(make_wsgi_app(registry))
        self._thread = threading.Thread(target=self.serve_forever, name="kdn-metrics-http",
                                        daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        request.settimeout(self.request_s)
        with self._lock:
            self._pending[request] = time.monotonic() + self.request_s
        try:
            super().process_request(request, client_address)  # (a thread of its own)
        except BaseException:
            self._forget(request)
            self.shutdown_request(request)
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception as exc:  # a client gone mid-answer, a timeout: nothing to report
            log.debug("metrics connection from %s: %r", client_address, exc)
        finally:
            self._forget(request)  # before it is closed: ``service_actions`` never shuts a
            self.shutdown_request(request)  # descriptor another connection was given
            self._slots.release()

    def whole(self, request: socket.socket) -> None:
        """``request``'s connection has sent its whole request: no deadline from now on."""
        self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._pending.pop(request, None)

    def service_actions(self) -> None:
        """Close the connections whose request is not whole by their deadline (called by
        ``serve_forever`` every half second)."""
        now = time.monotonic()
        with self._lock:
            for sock in [s for s, deadline in self._pending.items() if deadline <= now]:
                del self._pending[sock]
                try:
                    sock.shutdown(socket.SHUT_RDWR)  # its thread's read ends; it closes it
                except OSError:
                    pass

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)
