"""Which Redis tier each run of a disk tier ran with, so that a Redis tier put back after runs
without it is named at start: it missed those runs' overwrites and deletes, and would serve
their older values (``TieredStore.get`` trusts any tier's hit).

The disk tier's LMDB ``info`` database records, at every start, the Redis tier the run uses
(``shown_url`` of its URLs, "" for none) and every Redis tier it ever ran with. A start whose
Redis tier this disk ran with before, but not on its last run, logs an ERROR that says to
flush that Redis tier's ``kdn:`` keys. Only the disk's own record is compared: a Redis tier
that several servers share (a fleet) never alarms a server whose disk kept running with it,
and one added for the first time does not alarm either. The reverse (a disk tier left out for
a run while Redis took writes) leaves no record anywhere and is not detected (README).
"""

from __future__ import annotations

import logging

import lmdb

from kdn.store.lmdb import LmdbTier
from kdn.store.redis_urls import shown_url
from kdn.store.tiered import TieredStore

log = logging.getLogger(__name__)

_LAST = b"redis_last"
_EVER = b"redis_ever"


def note_redis(store: TieredStore, redis_url: str) -> bool:
    """Record the Redis tier (``redis_url``; "" for none) this run of ``store``'s disk tier
    uses; True, with an ERROR logged, where that Redis tier missed an earlier run's writes.
    A store without a disk tier records nothing."""
    disk = next((t for t in store.tiers if isinstance(t, LmdbTier)), None)
    if disk is None:
        return False
    redis = shown_url(redis_url) if any(t.name == "redis" for t in store.tiers) else ""
    try:
        with disk.env.begin(db=disk.info, write=True) as txn:
            last = txn.get(_LAST)
            ever = set(bytes(txn.get(_EVER) or b"").decode().split("\n")) - {""}
            txn.put(_LAST, redis.encode())
            if redis:
                txn.put(_EVER, "\n".join(sorted(ever | {redis})).encode())
    except lmdb.Error as exc:  # (a full disk): the tier itself reports it where it matters
        log.warning("disk tier %s: could not record its redis tier (%s)", disk.path, exc)
        return False
    missed = bool(redis) and redis in ever and last is not None and bytes(last).decode() != redis
    if missed:
        log.error("redis tier %s: the last run on this disk tier (%s) ran without it (or with "
                  "another), so it missed that run's overwrites and deletes and may serve "
                  "their older values; flush its kdn: keys (redis-cli --scan --pattern 'kdn:*' "
                  "| xargs redis-cli del; shared by a fleet: every server's)", redis, disk.path)
    return missed
