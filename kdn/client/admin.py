"""Operator client for the ``KDNAdmin`` service: health, listing, keys, verify, gc, and
export/import through the export file (``kdn.client.exportfile``: its format and lifecycle).

Exports resume: an export into a file it wrote before, with the same filters and from the same
server (the address as given: a server restarted there resumes it), continues after the file's
last complete record. The Export stream has no deadline in all (it runs as long as there are
entries); each of its items must come within the client's ``timeout_s`` of being waited for,
so a server that stops sending ends it (DeadlineExceeded).

Imports read the file twice, one record in memory at a time: first every checksum and name (a
bad or unfinished file sends nothing), then the entries in batches. Imports are idempotent
(entries already present with identical bytes are skipped by the server), so re-running an
interrupted import finishes it. Records carry their entry's tenant: an admin's import restores
each to it, a tenant's import stores its own (and those of older files, which record none) under
its tenant and has the server reject other tenants'.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc

from kdn.client.client import Client
from kdn.client.deadline import time_left
from kdn.client.exportfile import (
    MAGIC,
    ExportWriter,
    Filter,
    Record,
    encode_record,
    read_records,
    scan,
)
from kdn.client.rpc import settles
from kdn.errors import (
    Corrupt,
    DeadlineExceeded,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
)
from kdn.names import (
    call_batches,
    check_key,
    check_key_prefix,
    check_namespace,
    check_scope,
)
from kdn.options import MAX_TTL_S
from kdn.status import from_grpc
from kdn.transport.metadata import EXPORT_SKIPPED_HEADER
from kdn.transport.pieces import Pieces, cut, piece_bytes
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc

__all__ = ["MAGIC", "AdminClient", "Record", "encode_record", "read_records"]
IMPORT_BATCH_BYTES = 32 << 20  # one Import call carries at most this much (or 64 records)
IMPORT_PIECE_BYTES = 16 << 20
IMPORT_REASONS = 8  # the rejected entries whose reasons an import's answer keeps (the first)
"""An imported value larger than this goes in pieces (a server's messages may be smaller than
this client's; its default is 256 MiB)."""


SERVICE = "kdn.v1.KDN"  # the service whose health turns NOT_SERVING while a tier is down
NO_KEY = "no API key"
"""``health_report``'s ``tiers_hidden`` where no key was sent (a probe: the services decide)."""


def _tier_status(tier: pb.TierStats) -> str:
    if tier.healthy and tier.degraded:
        return "DEGRADED"
    return "SERVING" if tier.healthy else "NOT_SERVING"


def _listing(namespace: str, key_prefix: bytes) -> bytes:
    """Check the filters of a listing or export: "" is every namespace, b"" every key; the
    prefix as bytes."""
    if namespace:
        check_namespace(namespace)
    return check_key_prefix(key_prefix)


def _tenant(tenant: str) -> str:
    """A request's tenant filter, checked: "" (the caller's own, or in a listing all it sees),
    a tenant name, or ``UNSCOPED``."""
    return check_scope(tenant) if tenant else ""


class _IdleDeadline:
    """A streamed gRPC call (``call``: its iterator, with ``cancel``) whose messages each come
    within ``seconds`` of being waited for, the first included: ``items`` yields them, and the
    call is cancelled (``fired``) once one is waited for longer. The time the caller spends
    on a message (writing it to a slow file) does not count. ``seconds`` None: no limit."""

    def __init__(self, call: Any, seconds: float | None) -> None:
        self._call, self._seconds = call, seconds
        self._since: float | None = None  # when the wait for the next message began
        self._done = threading.Event()
        self.fired = False

    def items(self) -> Iterator[Any]:
        if self._seconds is not None:
            threading.Thread(target=self._watch, name="kdn-idle-deadline", daemon=True).start()
        try:
            while True:
                self._since = time.monotonic()
                try:
                    item = next(self._call)
                except StopIteration:
                    return
                finally:
                    self._since = None
                yield item
        finally:
            self._done.set()

    def _watch(self) -> None:
        assert self._seconds is not None
        while True:
            since = self._since
            left = self._seconds if since is None else since + self._seconds - time.monotonic()
            if left <= 0:
                self.fired = True
                self._call.cancel()
                return
            if self._done.wait(left):
                return


class AdminClient(Client):
    """``Client`` plus the operator RPCs, over the same channel and metadata.

    Every method takes ``request_id`` like ``Client``'s; a method that makes several RPCs
    (paged ``ls``, batched ``import_from``) sends the same id with each.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._admin = pb_grpc.KDNAdminStub(self.rpc.channel)

    def health_report(self, *, request_id: str | None = None) -> dict[str, Any]:
        """What ``kdn admin health`` prints: the server-wide and ``kdn.v1.KDN`` health statuses,
        each tier's (from Stats: ``SERVING``, ``DEGRADED`` while part of a Redis Cluster
        answers, ``NOT_SERVING``), ``parts_down``: per degraded tier, the parts that do not
        answer (a cluster's masters, ``host:port``), and ``status``: ``SERVING`` when every one
        of them is, ``DEGRADED`` when the others are and some tier is, else ``NOT_SERVING``.
        Tiers are Stats', which auth refuses without a key (a container's probe): then
        ``tiers`` is None and ``tiers_hidden`` says why (``NO_KEY``; or that the key sent was
        refused, a revoked one: then nothing says whether the tiers serve), and a ``DEGRADED``
        tier goes unseen (``kdn.v1.KDN`` still goes NOT_SERVING while a tier is down)."""
        services = {name: self.health(name) for name in ("", SERVICE)}
        parts_down: dict[str, list[str]] | None = None
        hidden = None
        try:
            listed = self.stats(request_id=request_id).tiers
            tiers: dict[str, str] | None = {t.name: _tier_status(t) for t in listed}
            parts_down = {t.name: list(t.parts_down) for t in listed if t.parts_down}
        except (Unauthenticated, PermissionDenied) as exc:
            tiers, hidden = None, NO_KEY if isinstance(exc, Unauthenticated) and \
                not self.rpc.has_key else f"the API key was refused ({exc})"
        states = {*services.values(), *(tiers or {}).values()}
        status = "SERVING" if states == {"SERVING"} else \
            "DEGRADED" if states == {"SERVING", "DEGRADED"} else "NOT_SERVING"
        return {"status": status, "server": services.pop(""), "services": services,
                "tiers": tiers, "parts_down": parts_down, "tiers_hidden": hidden}

    @settles
    def ls(self, namespace: str = "", key_prefix: bytes = b"", model: str = "",
           tenant: str = "", limit: int = 0, *,
           request_id: str | None = None) -> Iterator[pb.EntryInfo]:
        key_prefix = _listing(namespace, key_prefix)
        tenant = _tenant(tenant)
        token = b""
        md = self.metadata(request_id)
        while True:
            req = pb.ListRequest(namespace=namespace, key_prefix=key_prefix,
                                 model_fingerprint=model, tenant=tenant, limit=limit,
                                 page_token=token)
            resp = self.rpc.call(functools.partial(self._list, req, md))
            yield from resp.entries
            token = resp.next_page_token
            if not token:
                return

    def _list(self, req: pb.ListRequest, md: tuple[tuple[str, str], ...]) -> pb.ListResponse:
        return self._admin.List(req, timeout=time_left(self.timeout_s),  # type: ignore[no-any-return]
                                metadata=md)

    @settles
    def inspect(self, key: bytes, namespace: str | None = None, *, tenant: str = "",
                request_id: str | None = None) -> pb.EntryInfo:
        """One entry, its layout included. ``namespace`` (here and in ``evict``, ``pin``,
        ``unpin``): None for the client's; ``tenant``: admins only, that tenant's entry ("": the
        caller's own; ``kdn.names.UNSCOPED``: one stored before the server had tenants)."""
        req = pb.InspectRequest(namespace=check_namespace(namespace or self.namespace),
                                key=check_key(key), tenant=self.scoped(tenant, request_id))
        md = self.metadata(request_id)
        return self.rpc.call(lambda: self._admin.Inspect(req, timeout=time_left(self.timeout_s),
                                                            metadata=md))

    @settles
    def _keys(self, rpc: Callable[..., pb.CountResponse], keys: list[bytes],
              namespace: str | None, tier: str, tenant: str, request_id: str | None) -> int:
        ns, ks = check_namespace(namespace or self.namespace), [check_key(k) for k in keys]
        scope, md = self.scoped(tenant, request_id), self.metadata(request_id)
        count = 0
        for batch in call_batches(ks):
            req = pb.KeysRequest(namespace=ns, keys=batch, tier=tier, tenant=scope)
            count += int(self.rpc.call(lambda req=req: rpc(  # type: ignore[misc]
                req, timeout=time_left(self.timeout_s), metadata=md),
                once=f"it may have reached the server: the keys may have been changed ({count} "
                     "counted before)").count)
        return count

    def evict(self, keys: list[bytes], namespace: str | None = None, tier: str = "", *,
              tenant: str = "", request_id: str | None = None) -> int:
        return self._keys(self._admin.Evict, keys, namespace, tier, tenant, request_id)

    def pin(self, keys: list[bytes], namespace: str | None = None, *, tenant: str = "",
            request_id: str | None = None) -> int:
        return self._keys(self._admin.Pin, keys, namespace, "", tenant, request_id)

    def unpin(self, keys: list[bytes], namespace: str | None = None, *, tenant: str = "",
              request_id: str | None = None) -> int:
        return self._keys(self._admin.Unpin, keys, namespace, "", tenant, request_id)

    @settles
    def verify(self, dry_run: bool = False, *,
               request_id: str | None = None) -> Iterator[pb.VerifyProgress]:
        md = self.metadata(request_id)
        return iter(self.rpc.call(lambda: list(self._admin.Verify(
            pb.VerifyRequest(dry_run=dry_run), timeout=time_left(self.timeout_s), metadata=md))))

    @settles
    def gc(self, *, request_id: str | None = None) -> pb.GcResponse:
        md = self.metadata(request_id)
        return self.rpc.call(lambda: self._admin.Gc(
            pb.GcRequest(), timeout=time_left(self.timeout_s), metadata=md))

    # -- export / import ------------------------------------------------------------------------

    @settles
    def export_to(self, path: Path, namespace: str = "", key_prefix: bytes = b"",
                  progress: Callable[[int, int], None] | None = None, *, tenant: str = "",
                  request_id: str | None = None) -> int:
        """Export into ``path``, or resume an interrupted export there (same filters; a
        finished file is left as it is: InvalidArgument, its entries may be stale, a new
        export goes into a new file); returns the records in the file. The end marker is
        written only when the listing is done. Corrupt, the file finished, where the server
        left entries out (no tier held a good copy of them). ``tenant``: admins only, this
        tenant's entries ("": every entry the caller sees). The stream has no deadline in all;
        each of its items must come within ``timeout_s`` (DeadlineExceeded: the server stopped
        sending)."""
        key_prefix = _listing(namespace, key_prefix)
        tenant = self.scoped(tenant, request_id)
        out = ExportWriter.open(Path(path), Filter(namespace, key_prefix, tenant),
                                source=self.address)
        if out.complete:
            raise InvalidArgument(f"{path} holds a finished export ({out.records} entries), "
                                  "left as it is; export into a new file")
        try:
            req = pb.ExportRequest(namespace=namespace, key_prefix=key_prefix, after=out.after,
                                   tenant=tenant,
                                   piece_bytes=piece_bytes(self.max_message_bytes))
            stream = self._admin.Export(req, timeout=None, metadata=self.metadata(request_id))
            idle = _IdleDeadline(stream, self.timeout_s)  # no deadline for all: one per item
            total = 0
            pieces = Pieces()  # a value larger than a message comes in pieces
            try:
                for item in idle.items():
                    total = total or int(item.total) + out.records
                    value = pieces.add(item)
                    if value is None:
                        continue
                    ttl = min(item.ttl_seconds, MAX_TTL_S)  # (an older server's: any)
                    expires = time.time() + ttl if ttl else 0.0
                    out.write(Record(item.namespace, item.key, item.cursor, value, item.tenant,
                                     expires, item.pinned))
                    if progress:
                        progress(out.records, total)
            except grpc.RpcError as exc:
                if idle.fired:
                    raise DeadlineExceeded(f"the Export stream sent nothing for {self.timeout_s:g}"
                                           " seconds") from None
                raise from_grpc(exc) from None
            if pieces.end():  # not a whole export: no end marker for it
                raise Corrupt("the Export stream ended inside a value (its last piece never "
                              "came); export again")
            out.finish()
        except BaseException:
            out.abandon()  # refused, or failed before its first entry: no file left behind
            raise
        finally:
            out.close()
        skipped = sum(int(v) for k, v in stream.trailing_metadata() or ()
                      if k == EXPORT_SKIPPED_HEADER and str(v).isdigit())
        if skipped:
            raise Corrupt(f"{skipped} entries were left out of {path}: no tier of the server "
                          f"holds a good copy of them (the file holds the other {out.records}; "
                          "kdn admin verify removes the damaged ones)")
        return out.records

    @settles
    def import_from(self, path: Path, progress: Callable[[int, int], None] | None = None,
                    batch: int = 64, *, request_id: str | None = None) -> pb.ImportResponse:
        """Import an export file. The whole file is checked first (checksums, names, its end
        marker), one record at a time, so a bad, cut off or foreign file sends nothing. Each
        entry is stored with the time to live it had left (one expired since the export is
        counted ``skipped``, not sent) and pinned where it was. The answer's ``reasons`` say
        why the first rejected entries were (``IMPORT_REASONS``; the server logs more)."""
        path = Path(path)
        n, tenanted = 0, ""
        for n, (_, r) in enumerate(scan(path), 1):
            try:
                check_namespace(r.namespace)
                check_key(r.key)
                if r.tenant:
                    check_scope(r.tenant)
                    tenanted = tenanted or r.tenant  # the first named
            except InvalidArgument as exc:
                raise InvalidArgument(f"{path}: record {n - 1}: {exc}") from None
        if tenanted:  # an older server would store every record under the caller's tenant
            self.scoped(tenanted, request_id)
        total = pb.ImportResponse()
        md = self.metadata(request_id)

        def send(items: list[pb.ImportItem]) -> None:
            def call() -> pb.ImportResponse:
                # a fresh iterator per attempt, so a retried call sends every item again
                return self._admin.Import(  # type: ignore[no-any-return]
                    iter(items), timeout=time_left(self.timeout_s), metadata=md)

            resp = self.rpc.call(call)
            total.imported += resp.imported
            total.skipped += resp.skipped
            total.rejected += resp.rejected
            total.reasons.extend(resp.reasons[:max(0, IMPORT_REASONS - len(total.reasons))])

        items: list[pb.ImportItem] = []
        size = records = done = 0
        largest = min(piece_bytes(self.max_message_bytes), IMPORT_PIECE_BYTES)  # a larger
        # value goes in pieces: small enough for a server whose messages are smaller
        for _, r in scan(path):
            ttl = min(r.expires_at - time.time(), MAX_TTL_S) if r.expires_at else 0.0
            if r.expires_at and ttl <= 0:  # expired since the export: as if deleted
                total.skipped += 1
                continue
            items += [pb.ImportItem(tenant=r.tenant, namespace=r.namespace, key=r.key,
                                    value=piece, offset=at, more=more, ttl_seconds=ttl,
                                    pin=r.pinned)
                      for at, piece, more in cut(r.value, largest)]
            size += len(r.value)
            records += 1
            if records >= batch or size >= IMPORT_BATCH_BYTES:
                send(items)
                done += records
                items, size, records = [], 0, 0
                if progress:
                    progress(done, n)
        if items:
            send(items)
            if progress:
                progress(n, n)
        return total
