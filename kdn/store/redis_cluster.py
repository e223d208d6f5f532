"""The Redis Cluster client the Redis tier uses (``kdn.store.redis_transport``): redis-py's,
made to live with a master that is stopped or cut off (it takes connections, nothing answers)
rather than killed."""

from __future__ import annotations

from typing import Any

import redis
from redis.cluster import RedisCluster


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
