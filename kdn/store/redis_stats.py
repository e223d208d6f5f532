"""What the Redis tier (``kdn.store.redis``) says it holds (``RedisTier.stats``): the sums over
the masters that answer (a master known not to answer is skipped, not waited on).

``entries`` counts manifests, one per entry however many parts it has (``DBSIZE`` counts every
Redis key: parts, and other clients' keys, too): exactly on a Redis of at most ``SAMPLE_KEYS``
keys, else estimated as ``DBSIZE`` times the share of manifests among the first ``SAMPLE_KEYS``
keys a ``SCAN`` walks (Redis's hash order, which does not follow the keys' names), so that the
stats (the health probe's call) cost a few round trips however much Redis holds. ``bytes`` is
Redis's ``used_memory``. The byte budget (``redis_bytes``) is each master's: a cluster's
capacity is that times its masters.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import redis
from redis.cluster import RedisCluster

from kdn.store.redis_errors import REDIS_ERRORS

__all__ = ["SAMPLE_KEYS", "held"]

SAMPLE_KEYS = 2000
"""Keys a Redis holds beyond which its entries are estimated, not counted (see above)."""


def held(client: redis.Redis | RedisCluster, blocked: Callable[[str], bool], prefix: bytes
         ) -> tuple[int, int, int, int]:
    """(entries, bytes used, masters that answered, masters known) of the tier's Redis, whose
    keys start with ``prefix``; ``blocked(name)``: a cluster master known not to answer."""
    entries = used = answered = 0
    masters: list[tuple[str, Any]] = [("", client)]  # (name, its client); "": standalone
    if isinstance(client, RedisCluster):
        masters = [(n.name, client.get_redis_connection(n)) for n in client.get_primaries()]
    for name, one in masters:
        if name and blocked(name):
            continue  # known not to answer: no call that waits out the timeout
        try:
            entries += _entries(one, prefix)
            used += int(one.info("memory")["used_memory"])
            answered += 1
        except (*REDIS_ERRORS, OSError):
            pass
    return entries, used, answered, len(masters)


def _entries(client: Any, prefix: bytes) -> int:
    """The manifests one Redis (one master) holds: counted, or estimated (module docstring)."""
    cursor, seen, manifests = 0, 0, 0
    while True:
        cursor, got = client.scan(cursor, count=1000)
        seen += len(got)
        manifests += sum(1 for k in got if k.startswith(prefix) and k.endswith(b"}:m"))
        if int(cursor) == 0:
            return manifests
        if seen >= SAMPLE_KEYS:
            return round(int(client.dbsize()) * manifests / seen)
