"""Many entries per call: GetMany / PutMany, through a shared segment, the network data path,
or inline.

``Client`` owns one ``DataPlane``, and the plane owns its two paths: ``same_host``
(``kdn.client.samehost.SameHostPath``: the shared segment, the fast path and the read arena of
a client on the server's host) and ``network`` (``kdn.client.remotepath.RemotePath``: the
server's network data path, for a client on another host without a segment). Where neither
is there, batches go inline by gRPC: each below the message limit; what does not fit in one
answer comes in the next. Entries larger than a batch can carry are reported as ``TOO_BIG``
so the client streams them (Retrieve / Store).

Reads through the segment hand out owned views (``SharedSegment.owned``): the region is reused
only once the caller dropped every view of it. Where the server lends its tenant's read arena
(``kdn.server.arena``, handed over the fast path), GetMany asks for leases: a RAM-tier entry
then comes as a copy-on-write view of the arena (``kdn.client.shm.LeasedArena``), and the
leases whose views are gone are given back with the next call. A lease the server answers with
a generation is kept (``LeasedArena.keep``, up to ``keep_leases_bytes``): later reads of the
key with the same namespace and layout are answered from it without a call while the arena's
word for it holds that generation (the server zeroes it when the key is written again, deleted
or evicted, before that call answers). An entry under ``SMALL_ENTRY_BYTES`` asked for alone
comes inside the answer instead (checked by the server as it is sent; no lease, not kept), the
one key by a shorter path (``get_one``). Before any of that, a small entry the arena's
directory lists is copied out of the arena with no call at all (``kdn.transport.directory``;
reported to the server with a later call, ``_report_reads``): the first read of a key too.
How an answer's entries are handed out, and a listed entry read, is ``kdn.client.getmany``.
Stores copy the encoded entries into one region, call PutMany, and give the region back when
the call returns (the server copied them out); a large batch on the fast path is pipelined
(``SameHostPath.put_pipelined``).

A server restart: a GetMany / PutMany naming the segment is answered NOT_FOUND (the new server
knows no such segment; nothing else answers NOT_FOUND to these calls, a miss is an absent
entry). The plane then attaches the segment again (``SameHostPath.renew``) and makes the call
once more, so the caller sees none of it; the network data path does the same with its
ticket (``RemotePath``). In the steady state this costs nothing: no call checks first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from google.protobuf.message import Message

from kdn.client.deadline import deadline_within, time_left
from kdn.client.fastwire import parsed
from kdn.client.getmany import inline_entry, listed_entry, place
from kdn.client.netpath import NetPath
from kdn.client.pending import PendingStore
from kdn.client.pipelined import write_parts
from kdn.client.received import Fetched, fetched
from kdn.client.remotepath import RemotePath
from kdn.client.samehost import SameHostPath
from kdn.codec import EncodedParts
from kdn.errors import Corrupt, KDNError, NotFound, RateLimited, TooLarge
from kdn.layout import Expected
from kdn.names import MAX_CALL_KEYS
from kdn.transport.wire import FAST_GET_MANY, FAST_PUT_MANY
from kdn.v1 import kdn_pb2 as pb

T = TypeVar("T", bound=Message)

INLINE_SLACK = 1 << 20
"""Bytes kept free of entries in an inline message (protobuf framing, the other fields), at
most a quarter of the message limit (a client of ``max_message_bytes`` of 1 MiB or less had
an inline budget of 1 byte: every entry of a batch stored on its own)."""
FIRST_REGION = 64 << 20
"""Bytes a GetMany may fill at most before sizes are known: the rest of the segment stays free
for other threads; an entry larger than this comes in a second call, into a region of its
exact size."""
INLINE_ENTRY_BYTES = 4 << 20
"""An entry asked for alone comes in one inline GetMany message up to here and streams past
it (``Retrieve``, one message per frame): past a few MB a stream moves an entry faster than
one message (``bench/roundtrip.py`` measures both)."""
STREAM_ENTRY_BYTES = 512 << 10
"""An entry of a batch from this size is not carried inline (``GetManyRequest.
inline_max_entry_bytes``: the answer gives its length) and comes with the batch's other large
ones by one RetrieveMany stream, a message a frame; smaller ones come inline, many a message.
Streamed, an entry costs ~0.5 ms of Python on the two sides (its header message, the checks);
a large unary message moves at about half a stream's speed: around this size the two costs
meet."""
INLINE_BYTES = 16 << 20
"""Entry bytes per inline message at most: a batch's many small entries (one entry alone only
up to ``INLINE_ENTRY_BYTES``), whose stream would cost ~0.15 ms of Python gRPC per message on
each side; past ~20 MB one big buffer to build, copy and fault in costs more per byte than a
stream, so larger entries stream."""


SMALL_ENTRY_BYTES = 64 << 10
"""An entry asked for alone through the segment comes inside the answer up to this size
(``GetManyRequest.inline_below_bytes``, checked by the server on the bytes it sends): no arena
lease to take, map and give back, no region; ~0.1 ms less a 4 KiB read on both sides. Larger
ones are leased (no copy). An entry below this size the arena's directory lists is read
before any of that, with no call (``getmany.listed_entry``); this is the way of one it does
not list."""


REPORT_READS = 1024
"""Reads from the arena's directory a client reports in a call of its own at most (they
ride on its next GetMany before that: ``GetManyRequest.read_listed``)."""
CLOSE_S = 1.0
"""Seconds ``DataPlane.close`` gives its calls to the server in all (reads reported, the
segment and the ticket given back): a server that answers does so in milliseconds."""


class TooBig:
    """Marks an entry a batch can not carry (larger than the segment or a message)."""


TOO_BIG = TooBig()
TOO_BIG_KEYS = 4096
"""Keys remembered as too large for an inline GetMany (the most recent ones)."""
PUT_INLINE_BYTES = 4 << 20
"""Bytes of one entry an inline PutMany carries at most (``store_many`` sends larger ones as
Store streams): past it the entry's joins into one message cost more than a stream's
messages."""
BATCH_BYTES = 1 << 30
"""Bytes of entries one PutMany through the segment carries at most (server limit: 2 GiB)."""


class DataPlane:
    """GetMany / PutMany of a client (module docstring)."""

    def __init__(self, stub: Any, call: Callable[[Callable[[], Any]], Any],
                 metadata: Callable[[str | None], Any], timeout_s: float | None, shm_bytes: int,
                 max_message_bytes: int, keep_leases_bytes: int | None = None,
                 net_host: str = "", net_tls: Any = None, net_connections: int = 0) -> None:
        self._stub = stub
        self._call = call
        self._metadata = metadata
        self.timeout_s = timeout_s
        self.inline_budget = max(1, min(INLINE_BYTES, max_message_bytes
                                        - min(INLINE_SLACK, max_message_bytes // 4)))
        self.entry_budget = min(INLINE_ENTRY_BYTES, self.inline_budget)
        """Bytes an inline answer carries for an entry asked for alone."""
        self._lock = threading.Lock()
        self._inline_ok = True
        self._too_big: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # inline only
        self.same_host = SameHostPath(stub, call, metadata, timeout_s, shm_bytes,
                                      keep_leases_bytes)
        self.network = RemotePath(stub, call, metadata, timeout_s, net_host, net_tls,
                                  net_connections)
        """The server's network data path (``net_host``: its host, "" for none; ``net_tls``:
        (ssl context, server name) when the channel speaks TLS; ``net_connections``: the
        connections a batch read is striped over, 0: chosen by size)."""

    def segment(self) -> tuple[Any, str]:
        """(segment, id) once attached; (None, "") when the plane has no segment."""
        return self.same_host.segment()

    @property
    def attached(self) -> bool:
        return self.segment()[0] is not None

    @property
    def direct(self) -> bool:
        """Batches of any size go without gRPC: through the segment, or the network data
        path (``kdn.client.netpath``)."""
        return self.attached or self.net() is not None

    @property
    def server_seals(self) -> bool:
        """The server seals staged entries (``AttachResponse.seals``)."""
        return self.same_host.server_seals

    def net(self) -> NetPath | None:
        """The network data path, for a client without a segment whose server offers one
        (asked once: ``Attach`` with ``remote``); None otherwise."""
        if not self.network.decided and self.segment()[0] is not None:
            self.network.skip()
        return self.network.path()

    def close(self) -> None:
        """Report the arena's reads, give the segment and the network ticket back (calls the
        server does without: it drops a segment whose client closed it, and a tenant's oldest
        tickets), and close the connections; those calls end within ``CLOSE_S`` in all, so
        that a server stopped or cut off holds a closing client no longer."""
        with deadline_within(CLOSE_S):
            arena = self.same_host.arena
            if arena is not None and self.same_host.server_alive():
                self._report_reads(arena, at_least=1)
            self.same_host.close()
            self.network.close()

    def _report_reads(self, arena: Any, at_least: int | None = None) -> None:
        """Report the entries read from the arena's directory in a call of its own once
        ``at_least`` are waiting (they ride on the next GetMany otherwise: a client that only
        reads listed entries would never report them). Best effort: what fails is not
        counted."""
        gens = arena.reads_to_report(at_least=REPORT_READS if at_least is None else at_least)
        if not gens:
            return
        seg_id = self.segment()[1]
        if not seg_id:
            return
        try:
            self._get(pb.GetManyRequest(segment_id=seg_id, lease=True, read_listed=gens), None)
        except KDNError:
            pass

    # -- reads ----------------------------------------------------------------------------------

    def _renewed(self, seg_id: str) -> bool:
        """After NOT_FOUND to a call naming segment ``seg_id`` (the server restarted):
        whether the segment was attached again, or the plane goes on without one, so that the
        call may be made once more (module docstring). Unavailable where the server can not
        be reached."""
        if not seg_id:
            return False
        self.same_host.renew(seg_id)
        if self.segment()[0] is None:
            self.network.reconsider()  # the new server can not map it: its data path, then
        return True

    def get_many(self, namespace: str, keys: Sequence[bytes], want: Expected,
                 request_id: str | None, *, pinned: bool = False
                 ) -> list[Fetched | TooBig | None]:
        """One entry per key: Fetched, None (a miss), or TOO_BIG (stream it instead).
        ``pinned``: the entries are bound for a CUDA device: a leased entry is then viewed
        read-only through the arena's mapping registered with CUDA (``LeasedArena.view``), so
        the host-to-device copy reads the server's pages with no copy on the host."""
        seg_id = self.segment()[1]
        with self.network.one_deadline():  # the data path's failure, then gRPC: one deadline
            try:
                return self._get_many(namespace, keys, want, request_id, pinned)
            except NotFound:
                if not self._renewed(seg_id):
                    raise
            return self._get_many(namespace, keys, want, request_id, pinned)

    def _get_many(self, namespace: str, keys: Sequence[bytes], want: Expected,
                  request_id: str | None, pinned: bool) -> list[Fetched | TooBig | None]:
        out: list[Fetched | TooBig | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        seg, seg_id = self.segment()
        net = self.net() if seg is None else None
        if net is not None:
            got = self.network.get_many(net, namespace, keys, want, pinned)
            if got is not None:
                return list(got)
        if seg is None and not self._inline_ok:
            return [TOO_BIG] * len(keys)
        if seg is None and self._too_big:  # streamed straight away: no call to learn it again
            with self._lock:
                known = [(namespace, keys[i]) in self._too_big for i in todo]
            for i, big in zip(todo, known):
                if big:
                    out[i] = TOO_BIG
            todo = [i for i, big in zip(todo, known) if not big]
        arena = self.same_host.arena if seg is not None else None
        if arena is not None and arena.kept_bytes and (arena.pressed() or
                                                       not self.same_host.server_alive()):
            arena.forget()  # the arena is full (the leases go back with this call), or the
            # server exited (its words say nothing any more)
        if arena is not None and arena.kept_bytes:  # kept leases still the server's values:
            left = []  # read again without a call
            for i in todo:
                got = arena.reuse((namespace, keys[i], want), pinned=pinned)
                if got is None:
                    left.append(i)
                    continue
                view, tier = got
                out[i] = fetched(view, tier, True, True, pinned=view.readonly)
            todo = left
        if arena is not None and todo and arena.has_directory and self.same_host.server_alive():
            left = []  # entries the arena's directory lists: read without a call
            for i in todo:
                listed = listed_entry(arena, namespace, keys[i], want)
                if listed is None:
                    left.append(i)
                else:
                    out[i] = listed
            todo = left
            if not todo:
                self._report_reads(arena)
        need = FIRST_REGION  # what the next call's region should hold (sizes learnt so far)
        rest: list[int] = []  # asked for by a later call (a server takes so many keys a call)
        while todo or rest:
            todo, rest = (todo + rest)[:MAX_CALL_KEYS], (todo + rest)[MAX_CALL_KEYS:]
            region = pb.Region(length=self.inline_budget if len(todo) > 1 else self.entry_budget)
            block: tuple[int, int] | None = None
            if seg is not None:
                block = seg.regions.alloc_largest(need)
                if block is None:  # every region is still being read: stream the rest
                    for i in todo + rest:
                        out[i] = TOO_BIG
                    return out
                region = pb.Region(offset=block[0], length=block[1])
            req = pb.GetManyRequest(namespace=namespace, keys=[keys[i] for i in todo],
                                    segment_id=seg_id if seg is not None else "",
                                    region=region, expect_layout_fingerprint=want.fingerprint,
                                    expect_tokens=want.tokens)
            if seg is None and len(todo) > 1:  # a batch's large entries stream instead
                req.inline_max_entry_bytes = STREAM_ENTRY_BYTES - 1
            elif seg is not None and len(todo) == 1:  # one small entry: in the answer
                req.inline_below_bytes = SMALL_ENTRY_BYTES
            released: list[int] = []
            if arena is not None:
                req.lease = True
                released = arena.take()
                req.release.extend(released)
                req.read_listed.extend(arena.reads_to_report())
            try:
                resp = self._get(req, request_id)
            except TooLarge as exc:
                if arena is not None:
                    arena.give_back(released)
                if seg is not None and block is not None:
                    seg.regions.free(*block)
                if seg is not None or isinstance(exc, RateLimited):
                    raise
                self._inline_ok = False  # the server's messages are smaller: stream instead
                for i in todo + rest:
                    out[i] = TOO_BIG
                return out
            except BaseException as exc:
                if arena is not None:
                    arena.give_back(released)
                if seg is not None and block is not None:
                    seg.give_back(*block, failed=exc)  # retired where unanswered
                raise
            unviewed = {ref.lease for ref in resp.entries if ref.lease}
            try:
                placed = place(resp, todo, (namespace, want), keys, seg, block, arena,
                               unviewed, pinned)
            finally:
                if unviewed and arena is not None:  # not handed out: given back with the next
                    arena.give_back(sorted(unviewed))
            for i, entry in placed.entries.items():
                out[i] = entry
            again, sizes, used = placed.again, placed.sizes, placed.used
            if seg is not None and block is not None:
                seg.regions.free(used, block[0] + block[1] - used)
            if seg is None and again:  # inline: large entries the message did not hold
                small = []  # stream (one RetrieveMany for all of them, a message a frame)
                for i, n in zip(again, sizes):
                    if n > self.entry_budget:  # streams when alone
                        self._remember_too_big(namespace, keys[i])
                    if n >= STREAM_ENTRY_BYTES:
                        out[i] = TOO_BIG
                    else:
                        small.append(i)
                sizes = [n for n in sizes if n < STREAM_ENTRY_BYTES]
                again = small
            capped = block is not None and block[1] >= need and block[1] < sizes[0] \
                if again else False  # our own cap was too small: ask again with the sizes
            if again and len(again) == len(todo) and not capped:
                out[again[0]] = TOO_BIG  # no room for it (message or segment): stream it
                again, sizes = again[1:], sizes[1:]
            # the next call: as large a region as the first (many entries still to come), or
            # the largest entry left if that is larger (+64: room to align its frames)
            need = max(FIRST_REGION, max(sizes, default=0) + 64)
            todo = again
        return out

    def get_one(self, namespace: str, key: bytes, want: Expected,
                request_id: str | None) -> Fetched | TooBig | None:
        """``get_many`` of one key for the CPU, with less of its machinery on the server's
        host, where a small entry comes inside the answer (``SMALL_ENTRY_BYTES``): one GetMany
        on the fast path asking as ``get_many`` asks (a region, leases), its answer handed
        out at once when it is a miss or an entry inline (a 4 KiB read spent ~0.05 ms of
        Python in the general loop), else by ``get_many``'s own code. Without a fast path or
        a read arena, with kept leases (one may answer without a call), or after an error
        that ``get_many`` handles (a restart, a path that went away, no room): ``get_many``."""
        sh = self.same_host
        seg, seg_id = sh.segment()
        arena = sh.arena
        if arena is not None and arena.has_directory and sh.server_alive():
            listed = listed_entry(arena, namespace, key, want)
            if listed is not None:
                self._report_reads(arena)
                return listed
        block = seg.regions.alloc_largest(FIRST_REGION) \
            if seg is not None and arena is not None and sh.fast and not arena.kept_bytes \
            else None
        if block is None:
            return self.get_many(namespace, [key], want, request_id)[0]
        released = arena.take()
        req = pb.GetManyRequest(namespace=namespace, keys=[key], segment_id=seg_id,
                                region=pb.Region(offset=block[0], length=block[1]),
                                expect_layout_fingerprint=want.fingerprint,
                                expect_tokens=want.tokens, lease=True,
                                release=released, inline_below_bytes=SMALL_ENTRY_BYTES,
                                read_listed=arena.reads_to_report())
        body: bytes | None = None
        try:
            body = sh.call(FAST_GET_MANY, req)
        except NotFound:  # the server restarted: get_many attaches again and asks again
            pass
        except BaseException as exc:
            arena.give_back(released)
            seg.give_back(*block, failed=exc)  # retired where unanswered
            raise
        if body is None:  # the path went (its connection closed): gRPC
            arena.give_back(released)
            seg.regions.free(*block)
            return self.get_many(namespace, [key], want, request_id)[0]
        try:
            resp = parsed(pb.GetManyResponse, body)
        except Corrupt:  # answered: the server is done with the region
            seg.regions.free(*block)
            raise
        ref = resp.entries[0] if len(resp.entries) == 1 else None
        if ref is not None and not ref.lease and (not ref.present or len(ref.data)):
            seg.regions.free(*block)
            if not ref.present:
                return None
            if not ref.written:
                raise Corrupt(f"GetMany answered {len(ref.data)} bytes inline for an entry of "
                              f"{ref.length}")
            return inline_entry(ref)
        if ref is None:
            seg.regions.free(*block)
            raise Corrupt(f"GetMany answered {len(resp.entries)} entries for 1 key")
        unviewed = {ref.lease} if ref.lease else set()
        try:  # (what it did not hand out of the region, it frees where it raises)
            placed = place(resp, [0], (namespace, want), [key], seg, block, arena, unviewed)
        finally:
            if unviewed:
                arena.give_back(sorted(unviewed))
        seg.regions.free(placed.used, block[0] + block[1] - placed.used)
        if placed.again:  # not written (no room): the general way, with the size it said
            return self.get_many(namespace, [key], want, request_id)[0]
        return placed.entries.get(0)

    def _remember_too_big(self, namespace: str, key: bytes) -> None:
        """``key`` is larger than one message holds: later reads stream it without asking
        (an entry stored again smaller is then streamed too, which is only slower)."""
        with self._lock:
            self._too_big[(namespace, key)] = None
            self._too_big.move_to_end((namespace, key))
            while len(self._too_big) > TOO_BIG_KEYS:
                self._too_big.popitem(last=False)

    def _get(self, req: pb.GetManyRequest, request_id: str | None) -> pb.GetManyResponse:
        return self._many(FAST_GET_MANY, req, self._stub.GetMany, pb.GetManyResponse,
                          request_id)

    def put_request(self, req: pb.PutManyRequest, request_id: str | None
                    ) -> pb.PutManyResponse:
        """One PutMany as it is (items that name regions of the segment, or carry bytes);
        made again naming the segment's new id where the server restarted."""
        try:
            return self._put(req, request_id)
        except NotFound:
            if not self._renewed(req.segment_id) or self.segment()[0] is None:
                raise
        req.segment_id = self.segment()[1]
        return self._put(req, request_id)

    def _put(self, req: pb.PutManyRequest, request_id: str | None) -> pb.PutManyResponse:
        return self._many(FAST_PUT_MANY, req, self._stub.PutMany, pb.PutManyResponse,
                          request_id)

    def _many(self, op: int, req: Any, rpc: Callable[..., Any], answer: type[T],
              request_id: str | None) -> T:
        """One GetMany / PutMany: on the fast path when there is one, else by gRPC (its
        deadline ``timeout_s``, or this thread's ``deadline_within`` if sooner)."""
        if req.segment_id and self.same_host.fast:
            out = self.same_host.call(op, req)
            if out is not None:
                return parsed(answer, out)
        md = self._metadata(request_id)
        return self._call(  # type: ignore[no-any-return]
            lambda: rpc(req, timeout=time_left(self.timeout_s), metadata=md))

    # -- writes ---------------------------------------------------------------------------------

    def put_many(self, namespace: str, items: Sequence[tuple[bytes, EncodedParts,
                                                             pb.StoreOptions]],
                 request_id: str | None) -> list[pb.StoreResponse | TooBig]:
        """Store every item (each checked by the server before any is stored, per call);
        TOO_BIG for items no batch can carry, and for every item of a batch sent inline
        (no segment, the network data path not taking it) that one of them is too large
        for: none is sent then."""
        seg_id = self.segment()[1]
        with self.network.one_deadline():
            try:
                return self._put_many(namespace, items, request_id)
            except NotFound:
                if not self._renewed(seg_id):
                    raise
            return self._put_many(namespace, items, request_id)

    def _put_many(self, namespace: str,
                  items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]],
                  request_id: str | None) -> list[pb.StoreResponse | TooBig]:
        out: list[pb.StoreResponse | TooBig] = [TOO_BIG] * len(items)
        seg, seg_id = self.segment()
        net = self.net() if seg is None else None
        if net is not None and self.network.put_many(net, namespace, items, out, BATCH_BYTES):
            return out
        piped = self.same_host.put_pipelined(namespace, items) if seg is not None else None
        if piped is not None:  # what it left: as below
            rest = [i for i, r in enumerate(piped) if r is None]
            for i, stored in enumerate(piped):
                if stored is not None:
                    out[i] = stored
            if len(rest) < len(items):
                for i, r in zip(rest, self._put_many(namespace, [items[i] for i in rest],
                                                     request_id) if rest else []):
                    out[i] = r
                return out
        limit = min(seg.size // 2, BATCH_BYTES) if seg is not None else self.inline_budget
        most = limit if seg is not None else self.put_inline_most  # one item
        if seg is None and len(items) > 1 and any(p.nbytes > most for _, p, _ in items):
            return out  # inline calls can't carry it whole: none sent (the caller streams it)
        batch: list[int] = []
        size = 0
        for i, (_, parts, _) in enumerate(items):
            n = parts.nbytes
            if n > most:
                continue
            if batch and (size + n > limit or len(batch) >= MAX_CALL_KEYS):
                self._put_batch(namespace, items, batch, out, request_id)
                batch, size = [], 0
            batch.append(i)
            size += (n + 63) // 64 * 64
        if batch:
            self._put_batch(namespace, items, batch, out, request_id)
        return out

    def _put_batch(self, namespace: str,
                   items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]],
                   batch: list[int], out: list[pb.StoreResponse | TooBig],
                   request_id: str | None) -> None:
        seg, seg_id = self.segment()
        req = pb.PutManyRequest(namespace=namespace, segment_id=seg_id if seg else "")
        block: tuple[int, int] | None = None
        if seg is not None:
            total = sum((items[i][1].nbytes + 63) // 64 * 64 for i in batch)
            start = seg.regions.alloc(total)
            if start is None:  # the segment is busy with reads: send these inline
                seg = None
                req.segment_id = ""
            else:
                block = (start, total)
        at = block[0] if block is not None else 0
        sent = False
        try:  # the region goes back whatever fails, the items' making included
            for i in batch:
                key, parts, opts = items[i]
                item = req.items.add(key=key, options=opts)
                if seg is not None:
                    write_parts(seg, at, parts)
                    item.region.offset, item.region.length = at, parts.nbytes
                    at += (parts.nbytes + 63) // 64 * 64
                else:
                    item.data = parts.to_bytes()
            sent = True
            resp = self._put(req, request_id)
        except BaseException as exc:
            if seg is not None and block is not None:  # retired where sent and unanswered
                seg.give_back(*block, failed=exc if sent else None)
            raise
        if seg is not None and block is not None:
            seg.regions.free(*block)
        for i, r in zip(batch, resp.results):
            out[i] = r

    @property
    def put_inline_most(self) -> int:
        """Bytes of one entry an inline PutMany carries at most (a larger one is TOO_BIG)."""
        return min(self.inline_budget, PUT_INLINE_BYTES)

    # -- asynchronous stores (``Client.store_async``) -------------------------------------------

    def put_async(self, namespace: str, key: bytes, opts: pb.StoreOptions, *,
                  parts: EncodedParts | None = None, staged: Any = None,
                  on_done: Any = None) -> PendingStore | None:
        """``SameHostPath.put_async``: None where it can not go that way."""
        return self.same_host.put_async(namespace, key, opts, parts=parts, staged=staged,
                                        on_done=on_done)

    def put_async_net(self, namespace: str, key: bytes, opts: pb.StoreOptions,
                      parts: EncodedParts, on_done: Any = None) -> PendingStore | None:
        """``put_async`` for a client without a segment: the store sent on this thread's
        network data path connection without waiting (it answers in order too). None where
        there is no data path or it failed (the caller stores it as ``store`` does)."""
        if self.net() is None or parts.nbytes > BATCH_BYTES:
            return None
        return self.network.put_async(namespace, key, opts, parts, on_done)

    def has_pending(self) -> bool:
        return self.same_host.has_pending() or self.network.has_pending()

    def settle_async(self, until: PendingStore | None = None) -> None:
        """Read this thread's unanswered asynchronous stores' answers, oldest first (up to
        ``until`` when given)."""
        self.same_host.settle(until)
        self.network.settle(until)

    def take_async_errors(self) -> list[KDNError]:
        """The errors of this thread's asynchronous stores answered since the last call."""
        return self.same_host.take_failed() + self.network.take_failed()
