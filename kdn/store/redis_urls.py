"""What a Redis Cluster's URLs give the Redis tier's transport (``kdn.store.redis_transport``):
the nodes to discover the cluster from, and the options every connection to any of its nodes
takes (user, password, TLS, the URL's query options), read as redis-py reads one URL.

A standalone Redis is reached through its URL as redis-py reads it (``from_url``). A cluster's
client is given nodes and options instead, so they are read here; what a cluster can not take
is refused (``ConfigError``): a ``unix://`` socket (a cluster's nodes name each other by host
and port), a database other than 0 (a cluster has only that one), and URLs that differ in
anything but host and port (one client reaches every node, the ones it discovers too, with
the same login and TLS).
"""

from __future__ import annotations

import re
from typing import Any

from redis.connection import SSLConnection, parse_url

from kdn.errors import ConfigError

__all__ = ["ClusterURLs", "cluster_urls", "shown_url"]

class ClusterURLs:
    """A cluster's startup ``nodes`` (host, port) and the connection ``options`` (redis-py
    ``Redis`` keyword arguments: ``username``, ``password``, ``ssl``, ``ssl_*``, ...)."""

    __slots__ = ("nodes", "options")

    def __init__(self, nodes: list[tuple[str, int]], options: dict[str, Any]) -> None:
        self.nodes, self.options = nodes, options

    def pool_options(self) -> dict[str, Any]:
        """``options`` as a connection pool takes them (TLS as its connection class)."""
        out = dict(self.options)
        if out.pop("ssl", False):
            out["connection_class"] = SSLConnection
        return out


_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*", re.IGNORECASE)


def shown_url(url: str) -> str:
    """``url`` (or a comma-separated list of them) for an error message or a log line: without
    user and password (``***`` in their place), nor a ``?password=`` query option's value
    (redis-py takes one there too)."""
    if "," in url:
        return ",".join(shown_url(u) for u in url.split(","))
    url = _QUERY_PASSWORD.sub(r"\1***", url)
    head, at, tail = url.rpartition("@")
    return f"{head.split('://')[0]}://***@{tail}" if at else url


def cluster_urls(urls: list[str]) -> ClusterURLs:
    """The nodes and options of a Redis Cluster's ``urls`` (see the module docstring);
    ``ConfigError`` naming ``redis_url`` for what a cluster can not take."""
    nodes: list[tuple[str, int]] = []
    options: dict[str, Any] | None = None
    for url in urls:
        try:
            got = parse_url(url)
        except ValueError as exc:
            raise ConfigError(f"redis_url: {shown_url(url)} is not a Redis URL: {exc}") from None
        if url.startswith("unix://"):
            raise ConfigError(f"redis_url: {shown_url(url)} is a unix socket; a Redis Cluster's "
                              "nodes are reached by host and port (redis:// or rediss://)")
        if got.get("db", 0) != 0:
            raise ConfigError(f"redis_url: {shown_url(url)} names database {got['db']}; a Redis "
                              "Cluster has database 0 only")
        got.pop("db", None)
        if got.pop("connection_class", None) is SSLConnection:
            got["ssl"] = True
        nodes.append((str(got.pop("host", "127.0.0.1")), int(got.pop("port", 6379))))
        if options is None:
            options = got
        elif got != options:
            raise ConfigError("redis_url: the cluster's URLs differ in more than host and port "
                              "(user, password, rediss://, query options); one client reaches "
                              "every node with the same ones")
    return ClusterURLs(nodes, options or {})
