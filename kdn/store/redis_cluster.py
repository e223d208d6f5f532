"""The Redis Cluster client the Redis tier uses (``kdn.store.redis_transport``): redis-py's,
made to live with a master that is stopped or cut off (it takes connections, nothing answers)
rather than killed, and whose calls wait for a free pooled connection (``pool_waited``) as the
standalone tier's do."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.cluster import RedisCluster

T = TypeVar("T")


def pool_waited(wait_s: float, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """``fn(*args, **kwargs)``, made again while it fails because every pooled connection to
    its node is busy, for up to ``wait_s``; then that error. redis-py's cluster client gives
    each node a pool that does not wait (``MaxConnectionsError`` at once, nothing sent),
    where the standalone tier's ``BlockingConnectionPool`` waits its ``timeout``."""
    deadline = time.monotonic() + wait_s
    pause = 0.001
    while True:
        try:
            return fn(*args, **kwargs)
        except redis.exceptions.MaxConnectionsError:
            left = deadline - time.monotonic()
            if left <= 0:
                raise
            time.sleep(min(pause, left))
            pause = min(pause * 2, 0.02)


class ClusterClient(RedisCluster):
    """A cluster client that does not send a command again to a node that timed out (a stopped
    or cut-off master: every try would wait out the socket timeout again, while the tier fails
    that master's slots at once from then on); refused connections and CLUSTERDOWN are still
    retried on a refreshed map, which is how a killed master's keys reach its promoted
    replica."""

    ERRORS_ALLOW_RETRY = tuple(e for e in RedisCluster.ERRORS_ALLOW_RETRY  # type: ignore[assignment]
                               if e is not redis.exceptions.TimeoutError)

    def command(self, **kwargs: Any) -> Any:
        """``COMMAND``, which redis-py's client asks of a random master as it starts (to learn
        where commands name their keys): asked of each master in turn, the default node first,
        until one answers, so that a stopped master (each try times out) does not stop the
        client from starting while the others answer."""
        if "target_nodes" in kwargs:
            return super().command(**kwargs)
        first = self.get_default_node()
        nodes = [n for n in (first, *self.get_primaries()) if n is not None]
        nodes = [n for i, n in enumerate(nodes) if n not in nodes[:i]]
        for i, node in enumerate(nodes):
            try:
                return super().command(target_nodes=node, **kwargs)
            except (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError):
                if i == len(nodes) - 1:
                    raise
        return super().command(**kwargs)  # no map: redis-py says why
