"""The write path: every way an entry is stored ends here.

Store and StoreMany (``kdn.server.receive``), PutMany inline, from a shared segment or through
the same-host fast path (``kdn.server.putmany``, ``kdn.server.fastpath``), and the network data
path's PutMany (``kdn.server.streamed``) receive and check an entry's bytes in their own way;
what an entry must be allowed to be, and how it is committed, is ``Ingest``'s:

1. ``check_header`` (or ``check_target`` and ``check_kind`` where the header is parsed from
   bytes already checked): the entry's name, options, size, codec and model are allowed here,
   before anything is charged or written;
2. ``checked``: the time its bytes' checks took, for ``kdn_entry_check_seconds``;
3. ``commit`` (a worker thread; on the event loop where the store is memory only): the tenant
   charged against its quota, the entry put, the messages memoised for its old value and its
   old arena copy dropped, its new arena copy published, the counters and usage recorded.

``delete_entry`` and ``recount_usage`` keep tenants' usage right on the other side: deletes,
and what left the store without a caller (expiry, eviction).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from kdn.codec.catalog import check_codec
from kdn.codec.format import Header, parse_header
from kdn.errors import InvalidArgument, LayoutMismatch, TooLarge
from kdn.keys import split_store_key, store_key
from kdn.options import MAX_TTL_S, Durability
from kdn.server.arena import LIST_BELOW_BYTES, Arena, Arenas, Slot, list_small
from kdn.server.auth import Authenticator, Principal
from kdn.server.config import ServerConfig
from kdn.server.usage import Usage
from kdn.server.wire_memo import WireMemo
from kdn.store.base import Tier
from kdn.store.framed import Framed
from kdn.store.tiered import TieredStore
from kdn.v1 import kdn_pb2 as pb


class Ingest:
    """Checks and commits entries for ``store`` (see the module docstring); ``count`` counts
    the servicer's counters."""

    def __init__(self, config: ServerConfig, store: TieredStore, auth: Authenticator,
                 arenas: Arenas, wire_memo: WireMemo, usage: Usage,
                 count: Callable[..., None]) -> None:
        self.config = config
        self.store = store
        self.auth = auth
        self.arenas = arenas
        self.wire_memo = wire_memo
        self.usage = usage
        self.count = count
        self._durabilities = {d.value for d in Durability  # those some tier here meets
                              if any(t.satisfies(d) for t in store.tiers)}
        self.max_receiving = max(config.ram_bytes, config.max_entry_bytes)
        """Bytes the writes being received may hold at once (``receiving``): the RAM
        budget, or one entry of the largest size taken where that is more."""
        self._receiving: dict[str, int] = {}  # by tenant
        self._receiving_lock = threading.Lock()

    @contextlib.contextmanager
    def receiving(self, principal: Principal, nbytes: int, what: str) -> Iterator[None]:
        """Count ``nbytes`` a write is receiving while it does (``reserve``, then
        ``release``)."""
        self.reserve(principal, nbytes, what)
        try:
            yield
        finally:
            self.release(principal, nbytes)

    def reserve(self, principal: Principal, nbytes: int, what: str) -> None:
        """Count ``nbytes`` more that a write is receiving: TooLarge (nothing counted) where
        the writes being received would hold more than ``max_receiving`` in all, or, where
        callers are authenticated, one tenant's more than half of it (or one entry of
        ``max_entry_bytes``, where that is more). Each write's bytes are its own tenant's
        quota's (``check_room``); these bound what many writes that send slowly, or stop,
        hold at once (a stopped one ends after the server's ``idle_timeout_s``)."""
        tenant = principal.tenant
        with self._receiving_lock:
            everyone, ours = sum(self._receiving.values()), self._receiving.get(tenant, 0)
            bound = max(self.max_receiving // 2, self.config.max_entry_bytes) if tenant \
                else self.max_receiving
            if everyone + nbytes > self.max_receiving or ours + nbytes > bound:
                whose = f", {ours} of them tenant {tenant!r}'s" if tenant else ""
                raise TooLarge(f"this {what} of {nbytes} bytes: the server is receiving "
                               f"{everyone} bytes of writes already{whose} (at most {bound}); "
                               "try again when they are in")
            self._receiving[tenant] = ours + nbytes

    def release(self, principal: Principal, nbytes: int) -> None:
        """``nbytes`` a write was receiving are in (or dropped)."""
        with self._receiving_lock:
            left = self._receiving.get(principal.tenant, 0) - nbytes
            if left > 0:
                self._receiving[principal.tenant] = left
            else:
                self._receiving.pop(principal.tenant, None)

    # -- checks ---------------------------------------------------------------------------------

    def check_header(self, tenant: str, msg: pb.StoreHeader) -> tuple[bytes, Header]:
        """A Store's header checked and parsed: (tier key, header); refused before anything
        is charged or written."""
        skey = self.check_target(tenant, msg.namespace, msg.key, msg.options, msg.total_bytes)
        header = parse_header(msg.container_header)
        if len(header.raw) != len(msg.container_header):
            raise InvalidArgument("container_header has trailing bytes after its checksum")
        self.check_kind(header, msg.layout_fingerprint)
        return skey, header

    def check_target(self, tenant: str, namespace: str, key: bytes, opts: pb.StoreOptions,
                     total: int) -> bytes:
        """The tier key of an entry of ``total`` bytes to store with ``opts``, once its name,
        options and size are allowed here."""
        skey = store_key(tenant, namespace or "default", key)
        if opts.durability not in self._durabilities:
            try:
                durability = Durability(opts.durability)
            except ValueError:
                raise InvalidArgument(f"unknown durability {opts.durability}") from None
            raise InvalidArgument(f"durability {durability.name} needs a tier this server "
                                  "does not have")
        self.check_size(total)
        return skey

    def check_size(self, total: int) -> None:
        """TooLarge for an entry of ``total`` bytes past ``max_entry_bytes``."""
        if total > self.config.max_entry_bytes:
            raise TooLarge(f"entry of {total} bytes exceeds max_entry_bytes "
                           f"{self.config.max_entry_bytes}")

    def check_kind(self, header: Header, layout_fingerprint: str = "") -> None:
        """An entry's codec and model allowed here (and its layout the one the caller named,
        where it named one); an entry of no tokens is not (no prefill to skip: a key for
        nothing, taking a slot)."""
        check_codec(header.mode, header.entry.codec.level)
        if header.entry.tokens == 0:
            raise InvalidArgument("the entry holds no tokens: there is no KV of nothing to store")
        if layout_fingerprint and layout_fingerprint != header.layout.fingerprint:
            raise InvalidArgument(
                f"layout_fingerprint {layout_fingerprint} does not match the container's "
                f"layout {header.layout.fingerprint}"
            )
        allowed = self.config.allowed_models
        if allowed and header.layout.model_fingerprint not in allowed:
            raise LayoutMismatch(
                f"model {header.layout.model_fingerprint} ({header.layout.model_name or '?'}) "
                "is not served here; allowed_models lists "
                + ", ".join(allowed)
            )

    def checked(self, header: Header, seconds: float) -> None:
        """Record that an entry's bytes took ``seconds`` to check."""
        self.usage.checked(header, seconds)

    # -- commit ---------------------------------------------------------------------------------

    def check_room(self, principal: Principal, sizes: list[tuple[bytes, int]]) -> list[int]:
        """TooLarge, before any entry of a batch is stored, when storing its items (``sizes``:
        store key and size, in the order they are committed) would take the tenant past its
        quota even once the entries they replace are given back: a batch that does not fit
        stores nothing. Else, for each item, the bytes its ``commit`` may take the tenant past
        the quota by: what the batch's later items give back (an overwrite that shrinks, after a
        new entry), so that a batch that fits is never refused part stored. (Each ``commit``
        charges again, exactly: writes racing the batch may still refuse a later item.)"""
        room = self.auth.room(principal)
        if room is None or sum(n for _, n in sizes) <= room:
            return [0] * len(sizes)
        held: dict[bytes, int] = {}  # store key -> its size once the batch's items so far are in
        grown: list[int] = []  # the batch's growth once each item is in
        for k, n in sizes:
            before = held[k] if k in held else self.store.presence(k).size
            held[k] = n
            grown.append((grown[-1] if grown else 0) + n - before)
        grows = grown[-1]
        if grows > room:
            raise TooLarge(f"tenant {principal.tenant!r} quota: this {written(len(sizes))} "
                           f"adds {grows} bytes, "
                           f"{room} left; nothing of it was stored")
        return [max(0, g - grows) for g in grown]

    def commit(self, principal: Principal, skey: bytes, value: bytes | memoryview | Framed,
               opts: pb.StoreOptions, header: Header | None = None,
               in_arena: tuple[Arena, Slot] | None = None, over: int = 0
               ) -> pb.StoreResponse:
        """Charge the tenant and put a checked entry.

        Under the entry's lock: the size it replaces is read, growth is charged (refused past
        the quota) before the put and refunded when the put fails; shrinkage is refunded after
        the put succeeds. Concurrent overwrites and deletes of one key thus count it once.
        ``over``: the bytes growth may go past the quota by (``check_room``: a batch's later
        items give them back).
        ``in_arena``: the arena slot ``value`` lies in (a same-host PutMany), published with
        the put so that same-host reads find it there. A time to live past ``MAX_TTL_S`` is
        cut to it (any client's: the wire takes up to 2**64 - 1 s)."""
        self.wire_memo.drop(skey)  # the old value's messages: never sent again (a new stamp)
        with self.store.entry_lock(skey):
            replaced = self.store.presence(skey)
            delta = len(value) - replaced.size
            if delta > 0:
                self.auth.charge(principal, delta, over)
            try:
                # a read-only byte view (PutMany) is stored as it is: tiers read any buffer
                tier = self.store.put(skey, value,  # type: ignore[arg-type]
                                      ttl_s=float(min(opts.ttl_seconds, MAX_TTL_S)) or None,
                                      pin=opts.pin,
                                      durability=Durability(opts.durability), verified=True)
            except BaseException:
                if delta > 0:
                    self.auth.charge(principal, -delta)
                raise
            self.arenas.drop(skey)  # nor the old value's arena copy (leases given keep it,
            # whole), now the new one is in: under the entry lock, so no copy of the old one is
            # read without a call from here on (kept leases: ``kdn.server.batch``)
            if in_arena is not None:  # ``value`` lives in the tenant's read arena (PutMany):
                stamp = self.store.memory_stamp(skey, expiring=True, value=value)  # reads
                if stamp:  # find it there (the RAM tier holds this very view)
                    in_arena[0].publish(in_arena[1], skey, stamp)
            arena = None if in_arena is not None or isinstance(value, Framed) or \
                len(value) >= LIST_BELOW_BYTES else self.arenas.existing(principal.tenant)
            small = 0 if arena is None else self.store.memory_stamp(skey, value=value)
            if delta < 0:
                self.auth.charge(principal, delta)
        if small and not isinstance(value, Framed):  # same-host clients read it without a
            # call, the first time too
            list_small(arena, self.store, skey, value, small)
        self.count("store.ok")
        self.count("bytes_in", len(value))
        if header is not None:
            self.usage.stored(skey, header, len(value))
        return pb.StoreResponse(stored_bytes=len(value), tier=tier, replaced=replaced.present)


def written(n: int) -> str:
    """A write of ``n`` entries in its caller's words, whichever call carried it: "entry", or
    "batch of n entries"."""
    return "entry" if n == 1 else f"batch of {n} entries"


def delete_entry(store: TieredStore, auth: Authenticator, skey: bytes,
                 tier: Tier | None = None) -> bool:
    """Delete ``skey`` from every tier (or only from ``tier``) and refund its tenant when the
    entry is gone from all tiers, once, under the entry's lock (see ``Ingest.commit``)."""
    with store.entry_lock(skey):
        before = store.lookup([skey])[0]
        found = store.delete(skey) if tier is None else bool(tier.delete(skey))
        if before.present and (tier is None or not store.lookup([skey])[0].present):
            auth.refund(split_store_key(skey)[0], before.size)
    return bool(found)


def recount_usage(store: TieredStore, auth: Authenticator) -> bool:
    """Set every tenant's usage to the bytes its entries hold in the tiers, with no entry
    changing meanwhile: at start-up, after ``Gc`` (TTL expiries and capacity evictions leave the
    store without a caller, so only a recount gives their bytes back), and once every tier is
    up again after one that was not (``kdn.server.app``). True where every tier answered.

    A tier that is down, or a part of one (a Redis Cluster master), may hold entries the tenant
    is charged for and no other tier does: a count without them would give their bytes back, and
    the tenant could store them over again once it answers. So while any is down (before or
    during the count) a tenant's usage is only raised to what was counted, never lowered (at
    start-up, from nothing: what the tiers that answer hold), and ``auth.usage_whole`` is false
    until a count with every tier up and whole (``whole``)."""
    with store.all_entries_locked():
        all_there = whole(store)
        counted = {tenant: sum(p.size for p in store.lookup(store.keys(f"{tenant}:".encode())))
                   for tenant in auth.config.policies}
        all_there = all_there and whole(store)  # none went down while listed (skipped)
        for tenant, nbytes in counted.items():
            auth.set_usage(tenant, nbytes if all_there else max(nbytes, auth.usage(tenant)))
        auth.usage_whole = all_there
    return all_there


def whole(store: TieredStore) -> bool:
    """Whether every tier is up and every part of each answers (no Redis Cluster master
    down): a listing of the store then holds every entry."""
    return not store.degraded and not store.parts_down()
