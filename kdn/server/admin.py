"""The operator service (``kdn.v1.KDNAdmin``): list, inspect, evict, pin, verify, export, gc...

Scoping follows the caller (``kdn.server.auth``): a tenant lists, inspects, exports and imports
only its own entries, and may evict them from a tier (no more than a delete of them does: a
fleet client drops a node's stale RAM copy so, ``kdn.client.fleet``); the admin role sees every
tenant and alone may pin, unpin, verify and collect garbage. Exported entries carry their
tenant, and an admin's import restores each to it (a backup of a server with tenants comes back
as it was); a tenant's import stores its own entries (and those recorded with no tenant) under
its tenant and refuses other tenants'. A server without tenants (no auth file) refuses the
records of a tenant: no caller of it could read them.
Handlers are thin: the hierarchy (``TieredStore``) does the work, tiers are read directly where
an operation must not promote (listing, verifying, exporting). An export is whole or says it is
not: refused (UNAVAILABLE) while a tier does not answer, each entry's first good copy sent (a
damaged one: the next tier's), and those with none anywhere counted in its trailers. A time
to live past ``kdn.options.MAX_TTL_S`` (an entry stored before kdn cut them) is exported and
imported as that.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import grpc

from kdn.codec.format import parse_container, parse_header
from kdn.codec.layouts import layout_to_proto
from kdn.errors import (
    Corrupt,
    InvalidArgument,
    KDNError,
    LayoutMismatch,
    NotFound,
    PermissionDenied,
    TierUnavailable,
    TooLarge,
)
from kdn.keys import split_store_key, store_key
from kdn.names import UNSCOPED, check_key_prefix, check_namespace, request_namespace
from kdn.options import MAX_TTL_S
from kdn.server.arena import Arenas
from kdn.server.auth import (
    Authenticator,
    Principal,
    acting_tenant,
    current_principal,
    require_admin,
)
from kdn.server.egress import Egress
from kdn.server.ingest import Ingest, delete_entry, recount_usage, whole
from kdn.server.rpc import Counters, rpc
from kdn.status import grpc_code
from kdn.store.base import Tier
from kdn.store.tiered import TieredStore
from kdn.transport.metadata import EXPORT_SKIPPED_HEADER
from kdn.transport.pieces import Pieces, cut, piece_bytes
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)
Scope = tuple[bytes, str, str | None]
"""A listing's tier-key prefix, namespace and tenant (``AdminServicer._scope``)."""
LIST_LIMIT = 1000
VERIFY_REPORT_EVERY = 256
REJECT_REASONS = 8
"""The rejected entries of one Import call whose reasons its answer carries (the first)."""
REJECT_LOG_PER_S = 10.0
"""Rejected imported entries logged a second at most (all calls); the others are counted into
the next line."""


def model_matches(wanted: str, info: pb.EntryInfo) -> bool:
    """``ls --model``: ``wanted`` is the stored model name, its last path part (a writer's
    local folder ``/models/SmolLM2-135M`` matches ``SmolLM2-135M``; letter case aside), or a
    prefix of the model fingerprint."""
    if info.model_fingerprint.startswith(wanted):
        return True
    name, want = info.model_name.rstrip("/").casefold(), wanted.rstrip("/").casefold()
    return bool(name) and (name == want or name.rsplit("/", 1)[-1] == want.rsplit("/", 1)[-1])


class AdminServicer(pb_grpc.KDNAdminServicer):
    in_flight: int = 0
    """Calls running now (``kdn.server.rpc.rpc``)."""

    def __init__(self, store: TieredStore, auth: Authenticator,
                 arenas: Arenas | None = None, ingest: Ingest | None = None,
                 counters: Counters | None = None, egress: Egress | None = None) -> None:
        self.store = store
        self.auth = auth
        self.arenas = arenas  # the servicer's read arenas: an evicted key's copy is dropped
        self.ingest = ingest  # the one write path: Import's entries go in as a Store's do
        self.counters = counters if counters is not None else Counters()
        """Its event counts: the KDN servicer's (``kdn.server.app``), so Stats has them."""
        self.egress = egress
        """The KDN servicer's egress caps: Export's items are paced as any read's."""
        self._rejects = (REJECT_LOG_PER_S, time.monotonic(), 0)  # allowance, stamp, not logged

    def count(self, name: str, n: int = 1) -> None:
        self.counters.add(name, n)

    # -- scoping --------------------------------------------------------------------------------

    def _scope(self, namespace: str, tenant: str) -> Scope:
        """What a listing or export of ``namespace`` ("" all) and ``tenant`` ("" all the
        caller sees) may show: a tier-key prefix, the namespace every key must have besides
        ("" none), and the tenant every key must belong to (None: any). An admin without
        ``tenant`` sees every tenant, so its namespace filter matches that namespace in each
        (which no one prefix can say); anyone else sees one tenant (another one: admins only,
        PermissionDenied), the unscoped key space ("") included: its keys have no tenant part,
        so no prefix alone keeps the named tenants' keys out of it."""
        p = current_principal.get()
        if namespace:
            check_namespace(namespace)
        if p.is_admin and not tenant:
            return b"", namespace, None
        scope = acting_tenant(p, tenant)
        head = scope + ":" if scope else ""
        return (head + namespace + "/" if namespace else head).encode(), "", scope

    def _visible(self, scope: Scope, key_prefix: bytes) -> list[bytes]:
        prefix, namespace, tenant = scope
        keys = self.store.keys(prefix)
        hp = check_key_prefix(key_prefix).hex()
        if namespace or hp or tenant is not None:
            keys = [k for k in keys if _matches(split_store_key(k), namespace, hp, tenant)]
        return keys

    def _read(self, skey: bytes) -> tuple[bytes, list[str]] | None:
        """The entry's bytes from the fastest tier holding it (no promotion) and tier names."""
        tiers = self.store.where(skey)
        for t in tiers:
            try:
                value = t.get(skey)
            except KDNError:
                continue
            if value is not None:
                return value, [x.name for x in tiers]
        return None

    def _age(self, skey: bytes) -> float:
        """Seconds since the entry was written: the oldest write time a tier recorded (a copy
        promoted to RAM keeps the disk copy's age); -1 when no tier records one (Redis)."""
        times = [w for t in self.store.where(skey) if (w := t.written_at(skey)) is not None]
        return max(0.0, time.time() - min(times)) if times else -1.0

    def _info(self, skey: bytes, with_layout: bool = False) -> pb.EntryInfo | None:
        got = self._read(skey)
        if got is None:
            return None
        value, tiers = got
        tenant, namespace, key = split_store_key(skey)
        info = pb.EntryInfo(namespace=namespace, key=key, tenant=tenant, size_bytes=len(value),
                            tiers=tiers, pinned=self.store.is_pinned(skey),
                            age_seconds=self._age(skey))
        try:
            h = parse_header(value)
        except KDNError:
            info.codec_mode = "<corrupt header>"
            return info
        info.model_fingerprint = h.layout.model_fingerprint
        info.model_name = h.layout.model_name
        info.layout_fingerprint = h.layout.fingerprint
        info.num_layers = h.layout.num_layers
        info.dtype = h.layout.dtype.value
        info.codec_mode = h.entry.codec.mode
        info.codec_level = h.entry.codec.level
        info.tokens = h.tokens
        if with_layout:
            info.layout.CopyFrom(layout_to_proto(h.layout))
        return info

    # -- RPCs -----------------------------------------------------------------------------------

    @rpc
    async def List(self, request: pb.ListRequest,
                   context: grpc.aio.ServicerContext) -> pb.ListResponse:
        scope = self._scope(request.namespace, request.tenant)
        limit = request.limit or LIST_LIMIT

        def run() -> pb.ListResponse:
            resp = pb.ListResponse()
            last = b""
            for k in self._visible(scope, request.key_prefix):
                if request.page_token and k <= request.page_token:
                    continue
                info = self._info(k)
                if info is None:
                    continue
                if request.model_fingerprint and not model_matches(
                        request.model_fingerprint, info):
                    continue
                if len(resp.entries) == limit:
                    resp.next_page_token = last
                    break
                resp.entries.append(info)
                last = k
            return resp

        return await asyncio.to_thread(run)

    @rpc
    async def Inspect(self, request: pb.InspectRequest,
                      context: grpc.aio.ServicerContext) -> pb.EntryInfo:
        ns = request_namespace(request.namespace)
        skey = store_key(acting_tenant(current_principal.get(), request.tenant), ns, request.key)
        info = await asyncio.to_thread(self._info, skey, True)
        if info is None:
            raise NotFound(f"no entry {request.key.hex()} in {ns!r}")
        return info

    def _admin_keys(self, request: pb.KeysRequest, *, admin: bool = True) -> list[bytes]:
        """The tier keys of an Evict/Pin/Unpin: of the named tenant (an admin's), or the
        caller's own. ``admin``: the caller must be one (Pin/Unpin; an Evict of one's own
        entries is any tenant's)."""
        principal = require_admin() if admin else current_principal.get()
        tenant = acting_tenant(principal, request.tenant)
        ns = request_namespace(request.namespace)
        return [store_key(tenant, ns, k) for k in request.keys]

    @rpc
    async def Evict(self, request: pb.KeysRequest,
                    context: grpc.aio.ServicerContext) -> pb.CountResponse:
        skeys = self._admin_keys(request, admin=False)
        name = request.tier or "ram"
        tier = next((t for t in self.store.tiers if t.name == name), None)
        if tier is None:
            raise InvalidArgument(f"no tier named {name!r}; tiers: "
                                  f"{[t.name for t in self.store.tiers]}")
        await asyncio.to_thread(self._drop_gone_pins, skeys)  # expired ones: pinned no more
        if any(self.store.is_pinned(k) for k in skeys):
            raise InvalidArgument("pinned entries can not be evicted; unpin them first")
        n = await asyncio.to_thread(lambda: sum(delete_entry(self.store, self.auth, k, tier)
                                                for k in skeys))
        for k in skeys:  # kept leases on their arena copies are read no more
            if self.arenas is not None:
                self.arenas.drop(k)
        return pb.CountResponse(count=n)

    @rpc
    async def Pin(self, request: pb.KeysRequest,
                  context: grpc.aio.ServicerContext) -> pb.CountResponse:
        skeys = self._admin_keys(request)
        present = await asyncio.to_thread(self.store.lookup, skeys)
        held = [(k, p.size) for k, p in zip(skeys, present) if p.present]
        if loose := await asyncio.to_thread(  # a queued write to a disk tier lands there
                lambda: [n for k, n in held if not any(
                    t.keeps_pins for t in self.store.where(k, queued=True))]):
            room = self.store.tiers[0].stats().capacity_bytes  # the RAM tier's budget
            hint = "a read brings one that fits into RAM" if max(loose) <= room else \
                f"one is larger than RAM ({room} bytes): store it again with a disk tier up"
            raise InvalidArgument(f"{len(loose)} of the entries are held only by a tier that "
                                  "does not keep pins (Redis evicts as its maxmemory chooses); "
                                  f"nothing pinned: {hint}")
        for k, _ in held:
            self.store.pin(k)
        return pb.CountResponse(count=sum(p.present for p in present))

    @rpc
    async def Unpin(self, request: pb.KeysRequest,
                    context: grpc.aio.ServicerContext) -> pb.CountResponse:
        skeys = self._admin_keys(request)
        n = sum(self.store.is_pinned(k) for k in skeys)
        for k in skeys:
            self.store.unpin(k)
        return pb.CountResponse(count=n)

    async def Verify(self, request: pb.VerifyRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.VerifyProgress]:
        try:
            require_admin()
        except KDNError as exc:
            await context.abort(grpc_code(exc), str(exc))
        down: list[str] = []  # not verified: said at the end, once the others are
        for tier in self.store.tiers:
            try:
                if not self.store.is_up(tier.name):
                    raise TierUnavailable("marked down")
                keys = await asyncio.to_thread(_all_keys, tier)
            except KDNError as exc:
                log.warning("verify: tier %s does not answer (%s); not verified", tier.name, exc)
                down.append(tier.name)
                continue
            prog = pb.VerifyProgress(tier=tier.name, total=len(keys))
            for i, k in enumerate(keys):
                bad = await asyncio.to_thread(self._verify_one, tier, k, request.dry_run)
                prog.scanned = i + 1
                if bad:
                    prog.corrupt += 1
                    prog.removed += 0 if request.dry_run else 1
                    prog.corrupt_keys.append(k.decode(errors="replace"))
                if (i + 1) % VERIFY_REPORT_EVERY == 0:
                    yield prog
                    del prog.corrupt_keys[:]
            prog.done = True
            yield prog
            if parts := tier.parts_down():  # its keys there were not listed: not verified
                down.append(f"{tier.name} ({', '.join(parts)})")
        if down:
            gone = TierUnavailable(f"tier {', '.join(down)} does not answer: not verified "
                                   "(the rest was); verify again once it is back")
            await context.abort(grpc_code(gone), str(gone))

    def _verify_one(self, tier: Tier, key: bytes, dry_run: bool) -> bool:
        try:
            value = tier.get(key)
        except KDNError:
            return False
        if value is None:
            return False
        try:
            parse_container(value, verify=True)
            return False
        except KDNError:
            tier.counters.add("corrupt")
            self.count("verify.corrupt")
            if not dry_run:
                tier.delete(key)
            return True

    def _whole(self) -> None:
        """TierUnavailable unless every tier answers, every part of it: an export now would
        leave out the entries only the others hold, and be taken for a whole backup."""
        down = [t.name for t in self.store.tiers if not self.store.is_up(t.name)]
        down += [f"{name} ({', '.join(parts)})"
                 for name, parts in self.store.parts_down().items()]
        if down:
            raise TierUnavailable(f"tier {', '.join(down)} does not answer: an export now "
                                  "would leave out the entries only it holds; export again "
                                  "once it is back (kdn admin health)")

    def _export_keys(self, scope: Scope, key_prefix: bytes) -> list[bytes]:
        self._whole()
        keys = self._visible(scope, key_prefix)
        self._whole()  # a tier that failed while listing: its keys are not all there
        return keys

    def _good_copy(self, skey: bytes) -> tuple[bytes | None, bool, float]:
        """The entry's first copy in read order that passes verification (no promotion),
        whether a damaged copy was found, and the seconds until that copy expires (0: never):
        (None, True, 0) where no tier holds a good one, (None, False, 0) where none holds it
        (deleted or expired since the listing). A tier that does not answer raises
        TierUnavailable (the export is not whole)."""
        damaged = False
        for t in self.store.tiers:
            if not self.store.is_up(t.name):
                self._whole()  # raises: its copy may be the only one
            try:
                value = t.get(skey)
                left = t.ttl_remaining(skey) if value is not None else None
                if value is None or (left is not None and left <= 0):
                    continue
                parse_container(value, verify=True)
                return bytes(value), damaged, min(left or 0.0, MAX_TTL_S)
            except Corrupt as exc:
                damaged = True
                t.counters.add("corrupt")
                log.warning("export: the copy of %s in tier %s is damaged (%s); reading the "
                            "next tier's", skey.decode(errors="replace"), t.name, exc)
            except TierUnavailable as exc:
                self.store.mark_down(t.name, exc)
                raise TierUnavailable(f"tier {t.name} failed during the export ({exc}); "
                                      "export again once it is back") from None
        return None, damaged, 0.0

    async def Export(self, request: pb.ExportRequest,
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.ExportItem]:
        """Every visible entry's first good copy, in key order. Refused (UNAVAILABLE) while a
        tier does not answer; an entry with no good copy anywhere is left out and counted in
        the trailer ``EXPORT_SKIPPED_HEADER`` (the caller must not take the file as whole)."""
        try:
            scope = self._scope(request.namespace, request.tenant)
            keys = await asyncio.to_thread(self._export_keys, scope, request.key_prefix)
        except KDNError as exc:
            await context.abort(grpc_code(exc), str(exc))
            return
        keys = [k for k in keys if not request.after or k > request.after]
        assert self.ingest is not None  # the server builds the admin servicer with it
        size = (max(256, min(piece_bytes(self.ingest.config.max_message_bytes),
                             request.piece_bytes))  # a larger value: in pieces (the
                if request.piece_bytes else 1 << 62)  # caller's limit too); a caller that
        # names none joins no pieces: it gets each value whole (too large: the call fails)
        total, skipped = len(keys), 0
        pacer = self.egress.pacer(current_principal.get().tenant, context.peer()) \
            if self.egress is not None and self.egress.on else None  # as any read's
        for k in keys:
            try:
                value, damaged, ttl = await asyncio.to_thread(self._good_copy, k)
            except KDNError as exc:
                await context.abort(grpc_code(exc), str(exc))
                return
            if value is None:
                if damaged:
                    skipped += 1
                    self.count("export.skipped_corrupt")
                continue
            tenant, namespace, key = split_store_key(k)
            if not tenant and self.auth.enabled:  # stored with no auth file: put back there
                tenant = UNSCOPED
            pinned = self.store.is_pinned(k)
            for at, piece, more in cut(value, size):
                item = pb.ExportItem(tenant=tenant, namespace=namespace, key=key, value=piece,
                                     cursor=k, total=total, offset=at, more=more,
                                     ttl_seconds=ttl, pinned=pinned)
                if pacer is not None:
                    await pacer.apace(item.ByteSize())
                yield item
                total = 0  # in the first item only
        if skipped:  # (the request id is there already: kept)
            context.set_trailing_metadata((*(context.trailing_metadata() or ()),
                                           (EXPORT_SKIPPED_HEADER, str(skipped))))

    def _import_one(self, principal: Principal, item: pb.ImportItem, value: bytes) -> bool:
        """Store one imported entry as a Store would (its checks, its tenant's quota, the
        one write path: ``Ingest``); False where the same bytes are there already. Its tenant
        is the recorded one (``UNSCOPED``: the unscoped key space; another than the caller's:
        admins only, PermissionDenied; on a
        server without tenants, none: InvalidArgument, no caller could read it there), or the
        caller's where none is recorded (a file of an older kdn, an unscoped server's).
        ``value``: the item's, joined from its pieces."""
        assert self.ingest is not None  # the server builds the admin servicer with it
        if item.tenant not in ("", UNSCOPED) and not self.auth.enabled:
            raise InvalidArgument(f"the entry is tenant {item.tenant!r}'s and this server has "
                                  "no tenants (no auth file): no caller could read it here; "
                                  "import it into a server whose auth file has that tenant")
        owner = replace(principal, tenant=acting_tenant(principal, item.tenant))
        self.ingest.check_size(len(value))
        header = parse_container(value, verify=True).header
        self.ingest.check_kind(header)
        skey = store_key(owner.tenant, request_namespace(item.namespace), item.key)
        with self.store.entry_lock(skey):
            existing = self._read(skey)
            if existing is not None and existing[0] == value:
                return False
        if not (math.isfinite(item.ttl_seconds) and item.ttl_seconds >= 0):
            raise InvalidArgument(f"ttl_seconds {item.ttl_seconds} is not a number of seconds "
                                  ">= 0")
        options = pb.StoreOptions(ttl_seconds=math.ceil(min(item.ttl_seconds, MAX_TTL_S)),
                                  pin=item.pin)
        self.ingest.commit(owner, skey, value, options, header)
        return True

    @rpc
    async def Import(self, request_iterator: AsyncIterator[pb.ImportItem],
                     context: grpc.aio.ServicerContext) -> pb.ImportResponse:
        resp = pb.ImportResponse()
        principal = current_principal.get()
        assert self.ingest is not None  # the server builds the admin servicer with it
        pieces = Pieces(limit=self.ingest.config.max_entry_bytes)
        held = 0  # the bytes of the value being joined, counted as received (``reserve``)
        refused: tuple[str, str, bytes] | None = None  # a value refused before its last piece
        try:
            async for item in request_iterator:
                if item.offset and refused == (item.tenant, item.namespace, bytes(item.key)):
                    continue  # its later pieces: dropped, the value counted once
                refused = None
                try:
                    if item.offset == 0:  # a value left unfinished: dropped, counted
                        self.ingest.release(principal, held)  # (before this one can fail)
                        held = 0
                        pieces.end()
                    self.ingest.reserve(principal, len(item.value), "Import")
                    held += len(item.value)
                    value = pieces.add(item)
                    if value is None:  # more pieces of it follow
                        continue
                    self.ingest.release(principal, held)
                    held = 0
                    done = await asyncio.to_thread(self._import_one, principal, item, value)
                except (Corrupt, InvalidArgument, LayoutMismatch, PermissionDenied,
                        TooLarge) as exc:
                    self.ingest.release(principal, held)
                    held = 0
                    pieces.drop()  # (at its last piece too: never counted abandoned besides)
                    if item.more:
                        refused = (item.tenant, item.namespace, bytes(item.key))
                    resp.rejected += 1  # this entry's fault (damaged, not allowed here,
                    self._rejected(resp, item, exc)  # another tenant's, past the quota): the
                    continue  # rest go on
                if done:
                    resp.imported += 1
                else:
                    resp.skipped += 1
        finally:
            self.ingest.release(principal, held)
        pieces.end()  # the stream may end inside a value
        resp.rejected += pieces.abandoned  # values whose last piece never came
        if pieces.abandoned and len(resp.reasons) < REJECT_REASONS:
            resp.reasons.append(f"{pieces.abandoned} entries whose last piece never came")
        return resp

    def _rejected(self, resp: pb.ImportResponse, item: pb.ImportItem, exc: KDNError) -> None:
        """Say why an imported entry was rejected: in the answer (the call's first
        ``REJECT_REASONS``) and in a warning (``REJECT_LOG_PER_S`` a second at most)."""
        what = f"key {bytes(item.key).hex()[:16]} in {(item.namespace or 'default')[:64]!r}" \
            + (f" of tenant {item.tenant[:64]!r}" if item.tenant else "")  # (as sent)
        if len(resp.reasons) < REJECT_REASONS:
            resp.reasons.append(f"{what}: {exc}")
        allowance, stamp, dropped = self._rejects
        now = time.monotonic()
        allowance = min(REJECT_LOG_PER_S, allowance + (now - stamp) * REJECT_LOG_PER_S)
        if allowance < 1:
            self._rejects = (allowance, now, dropped + 1)
            return
        self._rejects = (allowance - 1, now, 0)
        log.warning("import: rejected %s: %s%s", what, exc,
                    f" ({dropped} more rejected, not logged)" if dropped else "")

    @rpc
    async def Gc(self, request: pb.GcRequest,
                 context: grpc.aio.ServicerContext) -> pb.GcResponse:
        require_admin()

        def run() -> pb.GcResponse:
            resp = pb.GcResponse()
            for tier in self.store.tiers:
                try:
                    removed, freed = tier.sweep_expired()
                except KDNError:  # a tier down: swept another time
                    continue
                resp.removed += removed
                resp.freed_bytes += freed
            self._drop_gone_pins(self.store.pinned())
            resp.usage_recounted = recount_usage(self.store, self.auth)  # not with a tier down
            return resp

        return await asyncio.to_thread(run)

    def _drop_gone_pins(self, skeys: list[bytes]) -> None:
        """Unpin those of ``skeys`` that are pinned but no tier holds (their entry expired or
        left: a pin outlives no entry), asked under each key's entry lock, as stores pin; only
        while every tier is up and whole (a key of a Redis Cluster master down reads absent)."""
        if whole(self.store):
            for k in skeys:
                if self.store.is_pinned(k):
                    with self.store.entry_lock(k):
                        if not self.store.presence(k).present and whole(self.store):
                            self.store.unpin(k)


def _matches(parts: tuple[str, str, bytes], namespace: str, hex_prefix: str,
             tenant: str | None = None) -> bool:
    """Whether a tier key's (tenant, namespace, key) is ``tenant``'s (None any), in
    ``namespace`` ("" any) and starts with ``hex_prefix``."""
    return ((tenant is None or parts[0] == tenant) and (not namespace or parts[1] == namespace)
            and parts[2].hex().startswith(hex_prefix))


def _all_keys(tier: Tier) -> list[bytes]:
    return list(tier.keys(b""))
