"""Operator client for the ``KDNAdmin`` service, and the export file format.

An export file holds verified entries, one record each, so a knowledge base can move between
servers through a file::

    file   = b"KDNX1\\n" record*
    record = u16 len(namespace) | namespace | u16 len(key) | key | u16 len(cursor) | cursor
             | u64 len(value) | value | u64 xxh3_64 of everything before it in the record

Exports resume: an existing file is scanned, a torn last record is cut off, and the export
continues after the last complete record's cursor. Imports are idempotent (entries already
present with identical bytes are skipped by the server), so re-running an interrupted import
finishes it.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import xxhash

from kdn.client.client import Client
from kdn.errors import Corrupt, InvalidArgument, PermissionDenied, Unauthenticated
from kdn.names import check_key, check_key_prefix, check_namespace, check_tenant
from kdn.status import from_grpc
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc

MAGIC = b"KDNX1\n"
_H = struct.Struct("<H")
_Q = struct.Struct("<Q")


@dataclass(frozen=True)
class Record:
    namespace: str
    key: bytes
    cursor: bytes
    value: bytes


def encode_record(r: Record) -> bytes:
    ns = r.namespace.encode()
    body = b"".join([_H.pack(len(ns)), ns, _H.pack(len(r.key)), r.key, _H.pack(len(r.cursor)),
                     r.cursor, _Q.pack(len(r.value)), r.value])
    return body + _Q.pack(xxhash.xxh3_64_intdigest(body))


def read_records(path: Path) -> tuple[list[Record], int]:
    """Complete records of an export file and the byte length they cover (a torn tail,
    e.g. from an interrupted export, is not counted)."""
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise Corrupt(f"{path} is not a kdn export file")
    out: list[Record] = []
    good = off = len(MAGIC)
    while off < len(data):
        fields: list[bytes] = []
        try:
            for size in (_H, _H, _H, _Q):
                (n,) = size.unpack_from(data, off)
                off += size.size
                if off + n > len(data):
                    raise struct.error("torn record")
                fields.append(data[off : off + n])
                off += n
            (want,) = _Q.unpack_from(data, off)
        except struct.error:
            break  # a torn tail: everything before it is intact
        if xxhash.xxh3_64_intdigest(data[good:off]) != want:
            raise Corrupt(f"{path}: record at byte {good} fails its checksum")
        try:
            namespace = fields[0].decode()
        except UnicodeDecodeError:
            raise InvalidArgument(f"{path}: record at byte {good}: the namespace is not "
                                  "UTF-8") from None
        off += _Q.size
        good = off
        out.append(Record(namespace, fields[1], fields[2], fields[3]))
    return out, good


SERVICE = "kdn.v1.KDN"  # the service whose health turns NOT_SERVING while a tier is down


def _tier_status(tier: pb.TierStats) -> str:
    if tier.healthy and tier.degraded:
        return "DEGRADED"
    return "SERVING" if tier.healthy else "NOT_SERVING"


def _listing(namespace: str, key_prefix: bytes) -> None:
    """Check the filters of a listing or export: "" is every namespace, b"" every key."""
    if namespace:
        check_namespace(namespace)
    check_key_prefix(key_prefix)


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
        of them is, ``DEGRADED`` when the others are and some tier is, else ``NOT_SERVING``."""
        services = {name: self.health(name) for name in ("", SERVICE)}
        parts_down: dict[str, list[str]] | None = None
        try:
            listed = self.stats(request_id=request_id).tiers
            tiers: dict[str, str] | None = {t.name: _tier_status(t) for t in listed}
            parts_down = {t.name: list(t.parts_down) for t in listed if t.parts_down}
        except (Unauthenticated, PermissionDenied):  # no key (a container's health check):
            tiers = None  # kdn.v1.KDN still goes NOT_SERVING while a tier is down
        states = {*services.values(), *(tiers or {}).values()}
        status = "SERVING" if states == {"SERVING"} else \
            "DEGRADED" if states == {"SERVING", "DEGRADED"} else "NOT_SERVING"
        return {"status": status, "server": services.pop(""), "services": services,
                "tiers": tiers, "parts_down": parts_down}

    def ls(self, namespace: str = "", key_prefix: bytes = b"", model: str = "",
           tenant: str = "", limit: int = 0, *,
           request_id: str | None = None) -> Iterator[pb.EntryInfo]:
        _listing(namespace, key_prefix)
        if tenant:
            check_tenant(tenant)
        token = b""
        md = self.metadata(request_id)
        while True:
            req = pb.ListRequest(namespace=namespace, key_prefix=key_prefix,
                                 model_fingerprint=model, tenant=tenant, limit=limit,
                                 page_token=token)
            resp = self.rpc.call(functools.partial(self._admin.List, req, timeout=self.timeout_s,
                                                metadata=md))
            yield from resp.entries
            token = resp.next_page_token
            if not token:
                return

    def inspect(self, key: bytes, namespace: str = "default", *,
                request_id: str | None = None) -> pb.EntryInfo:
        req = pb.InspectRequest(namespace=check_namespace(namespace or self.namespace),
                                key=check_key(key))
        md = self.metadata(request_id)
        return self.rpc.call(lambda: self._admin.Inspect(req, timeout=self.timeout_s, metadata=md))

    def _keys(self, rpc: Callable[..., pb.CountResponse], keys: list[bytes], namespace: str,
              tier: str, request_id: str | None) -> int:
        req = pb.KeysRequest(namespace=check_namespace(namespace or self.namespace),
                             keys=[check_key(k) for k in keys],
                             tier=tier)
        md = self.metadata(request_id)
        return int(self.rpc.call(lambda: rpc(req, timeout=self.timeout_s, metadata=md)).count)

    def evict(self, keys: list[bytes], namespace: str = "default", tier: str = "", *,
              request_id: str | None = None) -> int:
        return self._keys(self._admin.Evict, keys, namespace, tier, request_id)

    def pin(self, keys: list[bytes], namespace: str = "default", *,
            request_id: str | None = None) -> int:
        return self._keys(self._admin.Pin, keys, namespace, "", request_id)

    def unpin(self, keys: list[bytes], namespace: str = "default", *,
              request_id: str | None = None) -> int:
        return self._keys(self._admin.Unpin, keys, namespace, "", request_id)

    def verify(self, dry_run: bool = False, *,
               request_id: str | None = None) -> Iterator[pb.VerifyProgress]:
        md = self.metadata(request_id)
        return iter(self.rpc.call(lambda: list(self._admin.Verify(
            pb.VerifyRequest(dry_run=dry_run), timeout=self.timeout_s, metadata=md))))

    def gc(self, *, request_id: str | None = None) -> pb.GcResponse:
        md = self.metadata(request_id)
        return self.rpc.call(lambda: self._admin.Gc(pb.GcRequest(), timeout=self.timeout_s,
                                                 metadata=md))

    # -- export / import ------------------------------------------------------------------------

    def export_to(self, path: Path, namespace: str = "", key_prefix: bytes = b"",
                  progress: Callable[[int, int], None] | None = None, *,
                  request_id: str | None = None) -> int:
        """Export (or resume exporting) into ``path``; returns the records in the file."""
        _listing(namespace, key_prefix)
        path = Path(path)
        after = b""
        done = 0
        if path.exists() and path.stat().st_size > 0:
            records, good = read_records(path)
            with open(path, "r+b") as f:
                f.truncate(good)
            if records:
                after, done = records[-1].cursor, len(records)
        else:
            path.write_bytes(MAGIC)
        req = pb.ExportRequest(namespace=namespace, key_prefix=key_prefix, after=after)
        stream = self._admin.Export(req, timeout=None, metadata=self.metadata(request_id))
        total = 0
        with open(path, "ab") as f:
            try:
                for item in stream:
                    total = total or int(item.total) + done
                    f.write(encode_record(Record(item.namespace, item.key, item.cursor,
                                                 item.value)))
                    done += 1
                    if progress:
                        progress(done, total)
            except grpc.RpcError as exc:
                raise from_grpc(exc) from None
        return done

    def import_from(self, path: Path, progress: Callable[[int, int], None] | None = None,
                    batch: int = 64, *, request_id: str | None = None) -> pb.ImportResponse:
        records, _ = read_records(Path(path))
        for i, r in enumerate(records):  # every name first: a bad record sends nothing
            try:
                check_namespace(r.namespace)
                check_key(r.key)
            except InvalidArgument as exc:
                raise InvalidArgument(f"{path}: record {i}: {exc}") from None
        total = pb.ImportResponse()
        md = self.metadata(request_id)
        for start in range(0, len(records), batch):
            chunk = records[start : start + batch]
            items = [pb.ImportItem(namespace=r.namespace, key=r.key, value=r.value)
                     for r in chunk]

            def send(items: list[pb.ImportItem] = items) -> pb.ImportResponse:
                # a fresh iterator per attempt, so a retried call sends every item again
                return self._admin.Import(iter(items), timeout=self.timeout_s,  # type: ignore[no-any-return]
                                          metadata=md)

            resp = self.rpc.call(send)
            total.imported += resp.imported
            total.skipped += resp.skipped
            total.rejected += resp.rejected
            if progress:
                progress(start + len(chunk), len(records))
        return total
