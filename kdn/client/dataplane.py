"""Many entries per call: GetMany / PutMany, through a shared segment or inline.

``Client`` owns one ``DataPlane``. With ``shm_bytes`` set, the first call creates a
``kdn.client.shm.SharedSegment`` and attaches it (``Attach``); if the server can not map it
(another host, another container, no permission) the plane falls back to inline messages for
good and says so once in the log. Inline batches stay below the message limit; what does not
fit in one answer comes in the next. Entries larger than a batch can carry are reported as
``TOO_BIG`` so the client streams them (Retrieve / Store).

Reads through the segment hand out owned views (``SharedSegment.owned``): the region is reused
only once the caller dropped every view of it. Where the server lends its tenant's read arena
(``kdn.server.arena``, handed over the fast path), GetMany asks for leases: a RAM-tier entry
then comes as a copy-on-write view of the arena (``kdn.client.shm.LeasedArena``), and the
leases whose views are gone are given back with the next call. A lease the server answers with
a generation is kept (``LeasedArena.keep``, up to ``keep_leases_bytes``): later reads of the
key with the same namespace and layout are answered from it without a call while the arena's
word for it holds that generation (the server zeroes it when the key is written again, deleted
or evicted, before that call answers). Stores copy the encoded entries into one region, call
PutMany, and give the region back when the call returns (the server copied them out); a batch
larger than ``PIPE_BYTES`` goes as several calls on the fast path, each written while the
server copies the one before (``kdn.client.puts``).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any, TypeVar

from kdn.buffers import RECEIVED
from kdn.client.netpath import NetPath, fast_answer, fast_error, fast_send
from kdn.client.puts import TOO_BIG, PutsMixin, TooBig
from kdn.codec import EncodedParts
from kdn.codec.copies import FrameCopy
from kdn.codec.format import (
    Header,
    check_frame_prefix,
    declared_length,
    parse_container,
    parse_header,
)
from kdn.errors import (
    Corrupt,
    DeadlineExceeded,
    KDNError,
    NotFound,
    RateLimited,
    TooLarge,
    Unavailable,
)
from kdn.v1 import kdn_pb2 as pb
from kdn.wire import (
    ARENA_SIZE,
    FAST_ARENA,
    FAST_GET_MANY,
    FAST_HEAD,
    FAST_PUT_MANY,
    piece_fault,
    read_exact,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

INLINE_SLACK = 1 << 20
"""Bytes kept free of entries in an inline message (protobuf framing, the other fields)."""
FIRST_REGION = 64 << 20
"""Bytes a GetMany may fill at most before sizes are known: the rest of the segment stays free
for other threads; an entry larger than this comes in a second call, into a region of its
exact size."""
INLINE_ENTRY_BYTES = 4 << 20
"""An entry asked for alone comes in one inline GetMany message up to here and streams past
it (``Retrieve``, one message per frame). With the server in a process of its own, as a
remote client meets it, the raw service's stream beat its single message already at 11.8 MB
(0.85 against 0.73 GB/s on a 2-core VM, 1.60 against 1.10 on a 16-core host), and a
512-token SmolLM2 retrieve read 0.87x of the best raw figure streamed against 0.48x inline."""
STREAM_ENTRY_BYTES = 512 << 10
"""An entry of a batch from this size is not carried inline (``GetManyRequest.
inline_max_entry_bytes``: the answer gives its length) and comes with the batch's other large
ones by one RetrieveMany stream, a message a frame; smaller ones come inline, many a message.
Streamed, an entry costs ~0.5 ms of Python on the two sides (its header message, the checks);
a large unary message moves at about half a stream's speed. 64 entries on a 2-core VM, inline
against streamed: 276 KB 0.49 against 0.37 GB/s, 368 KB 0.55 against 0.45; 552 KB streamed
0.65 (506 KB inline 0.58); 1.15 MB 0.60 inline, 0.96 streamed."""
INLINE_BYTES = 16 << 20
"""Entry bytes per inline message at most: a batch's many small entries (one entry alone only
up to ``INLINE_ENTRY_BYTES``), whose stream would cost ~0.15 ms of Python gRPC per message on
each side; past ~20 MB one big buffer to build, copy and fault in costs more per byte than a
stream (47 MB: 75 ms inline against 26 ms streamed), so larger entries stream."""


@dataclass(frozen=True)
class Fetched:
    """A retrieved entry as its container header plus frames (not decoded)."""

    parts: EncodedParts
    tier: str
    owned: bool = False
    """The frames are views of a region of this client's segment that nothing else holds: the
    decoded tensors may view them in place (``StreamDecoder(borrow=True)``)."""
    checked: bool = False
    """The server verified every checksum on these very bytes after writing them into the
    segment (``EntryRef.verified``): decoding need not hash them again."""
    header: Header | None = None
    """``parts.header`` parsed, where the reader parsed it already (``parsed()``)."""
    container: memoryview | None = None
    """The whole entry (header then frames) as one view, where the reader has one: the
    segment's region when ``owned``, else memory that is not the caller's to change (the
    in-process tier's, read-only)."""
    pinned: bool = False
    """The bytes are page-locked for CUDA (the read arena's registered mapping, the in-process
    tier's pinned buffers): a copy to a GPU reads them where they lie."""
    private: bool = False
    """The frames are read-only views of messages this client received and nothing else
    holds (``received``): decoded CPU tensors may view them in place too
    (``StreamDecoder(private=True)``), and writes through those change nothing anyone else
    sees."""
    memo: dict[str, Any] | None = None
    """What readers derived from these bytes, kept by their holder as long as the bytes (the
    in-process tier's ``LocalHit.memo``), where the bytes never change: None elsewhere."""

    def parsed(self) -> Header:
        """``parts.header`` parsed (verified): the reader's parse where there is one."""
        return self.header if self.header is not None else parse_header(self.parts.header)


TOO_BIG_KEYS = 4096
"""Keys remembered as too large for an inline GetMany (the most recent ones)."""
FRAME_ALIGN = 64
"""A received entry's first frame starts at a multiple of this (``kdn.codec.inplace``)."""


def _fetched(buf: bytes | memoryview, tier: str, owned: bool = False,
             checked: bool = False, pinned: bool = False, whole: bool = False) -> Fetched:
    """Header and frame views of one container (checked when decoded); ``whole``: the
    container as one view although not the caller's (an inline answer's bytes), so that
    decoding copies it once, checked, into a buffer its tensors view."""
    c = parse_container(buf, verify=False)
    return Fetched(EncodedParts(c.header.raw, list(c.frames)), tier,  # type: ignore[arg-type]
                   owned, checked, c.header, memoryview(buf) if owned or whole else None,
                   pinned)


KEEP_MESSAGES_BYTES = 64 << 20
"""A received entry up to this size stays in the messages it came in (``received``); a larger
one is copied into one buffer (``kdn.buffers.RECEIVED``, recycled up to its ``keep_bytes``)
as they arrive, in pieces (``PIECE_BYTES``). Kept, an entry costs one hash of its bytes where
they landed; copied, a copy too, but its memory is never fresh: the allocator keeps freed
memory up to ``kdn.buffers.TRIM_THRESHOLD``, and past that every message of the next entry
faulted in new pages (SmolLM2 entries, 2-core VM, server in its own process: at 47 MB 0.89x
of the raw stream kept against 0.73x copied; at 189 MB 16-34 thousand page faults a read
kept, 0.67-0.75x, against 0.85-0.87x copied). An entry larger than ``RECEIVED.keep_bytes``
lands in fresh memory either way: copied, its pieces are the messages it travels in."""


def keeps_messages(total: int) -> bool:
    """Whether the frames of a ``total``-byte entry arriving one message each are best left
    in their messages (a ``LayerStream``'s decoder then views them): up to
    ``KEEP_MESSAGES_BYTES``, and past what the recycled buffers keep (fresh memory either
    way). ``received`` copies every entry above ``KEEP_MESSAGES_BYTES``: asked for in pieces,
    they come in messages too small to keep."""
    return total <= KEEP_MESSAGES_BYTES or total > RECEIVED.keep_bytes


PIECE_BYTES = 1 << 20
"""Pieces a copied entry's frames are asked in (``RetrieveRequest.piece_bytes``): the message
size Python gRPC moves fastest (raw streams of 180 MB on a 2-core VM: 1.42-1.54 GB/s in 1 MiB
messages, 0.82-1.28 in 6 MiB ones), and a piece is copied while it is still in cache (a copy
and hash of each message kept 1.11-1.28 GB/s in 1 MiB pieces, 0.68-0.74 in 6 MiB)."""


def ask_pieces(req: pb.RetrieveRequest) -> pb.RetrieveRequest:
    """``req`` asking for the frames of an entry that ``received`` copies in pieces
    (``PIECE_BYTES``); an entry it keeps comes one message per frame."""
    req.piece_bytes, req.piece_min_entry_bytes = PIECE_BYTES, KEEP_MESSAGES_BYTES + 1
    return req


def received(head: pb.RetrieveHeader, frames: Iterator[Any]) -> Fetched:
    """A Retrieve stream's entry, each frame checked as it lands: kept in its messages up to
    ``KEEP_MESSAGES_BYTES`` (the frames are views of them, hashed where they lie,
    ``private``), else copied into one recycled buffer and hashed chunk by chunk as it is
    copied (``owned``): each message copied and hashed as it lands, while in cache, then
    dropped. A frame may come in pieces (``Frame.offset``, ``ask_pieces``): copied piece by
    piece (kept, its pieces are joined). A frame is checked the moment its last byte lands
    (its prefix says how long it is), on this thread, while the message is in cache: a 12 MB
    read spent ~0.7 ms more handing 1.2 MB frames to other threads than hashing them here,
    and hashing each frame only once the next one arrived hashed memory the next message had
    pushed out of cache. The entry comes back ``checked``. Raises Corrupt when a frame is
    damaged or out of its place, a piece does not continue its frame, or the frames do not
    add up to the header's frames and ``total_bytes``."""
    header = bytes(head.container_header)
    total = int(head.total_bytes)
    if total < len(header):
        raise Corrupt(f"entry of {total} bytes can not hold its {len(header)}-byte header")
    parsed = parse_header(header)
    keep = total <= KEEP_MESSAGES_BYTES
    kept: list[bytes | memoryview] = []
    buf = memoryview(b"")
    if not keep:
        room = RECEIVED.take(total + FRAME_ALIGN)
        start = -(room.ctypes.data + len(header)) % FRAME_ALIGN  # frames aligned: raw bodies
        buf = memoryview(room)[start : start + total]  # type: ignore[arg-type]  # viewed in
        buf[: len(header)] = header  # place
    at = len(header)
    index, sent_as, begun, last = -1, 0, at, -1  # the frame being received: its index, the
    # message's index for it, where it begins, the length of its latest piece (-1: none yet)
    size, done = -1, False  # its length as its prefix declares it (-1: unreadable), finished
    pieces: list[bytes | memoryview] = []  # kept: its pieces so far
    copy: FrameCopy | None = None  # copied: its copy so far

    def finish() -> None:  # frame ``index`` has all its pieces
        if copy is not None:
            copy.check()
            return
        data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
        kept.append(data)
        check_frame_prefix(parsed, index, data)

    for msg in frames:  # waiting for the next message, the GIL is free
        if msg.WhichOneof("part") != "frame":
            raise Corrupt(f"a {msg.WhichOneof('part')} arrived where frame {index + 1} of the "
                          "entry was due")
        data, offset = msg.frame.data, msg.frame.offset
        if at + len(data) > total:
            raise Corrupt(f"frames exceed the entry's {total} bytes")
        if offset:
            fault = piece_fault(msg.frame, sent_as if last >= 0 else None, at - begun, last)
            if fault:
                raise Corrupt(fault)
        else:
            if last >= 0 and not done:
                finish()
            index, sent_as, begun, pieces = index + 1, msg.frame.index, at, []
            size, done = declared_length(data), False
            copy = None if keep else FrameCopy(parsed, index, buf[at:])
        if size >= 0 and at - begun + len(data) > size:
            raise Corrupt(f"frame {index}: more than the {size} bytes its prefix declares")
        if copy is not None:  # copied and hashed now, while the message is in cache
            copy.add(data)
        else:
            pieces.append(data)
        last = len(data)
        at += len(data)
        if at - begun == size:  # whole: checked now, while its last bytes are in cache
            finish()
            done = True
    if last >= 0 and not done:
        finish()
    if at != total:
        raise Corrupt(f"stream ended after {at} of the entry's {total} bytes")
    if not keep:
        return _fetched(buf, head.tier, owned=True, checked=True)
    if len(kept) != len(parsed.entry.frames):
        raise Corrupt(f"stream brought {len(kept)} of the entry's {len(parsed.entry.frames)} "
                      f"frames")
    return Fetched(EncodedParts(header, kept), head.tier,  # type: ignore[arg-type]
                   checked=True, header=parsed, private=True)


def received_many(count: int, stream: Iterator[Any]) -> list[Fetched | None]:
    """A RetrieveMany stream's ``count`` entries, in order (None for a key with no entry):
    each header, then its ``frame_count`` frames read by ``received``; in the grouped form
    (``RetrieveHeaders``) a run's headers at once, an entry that came whole in its header as
    ``fetch_many`` takes an inline one (checked when decoded), the run's others read from
    the messages that follow. Raises Corrupt when the stream holds anything else: a frame
    where a header is due, an entry at odds with its header, fewer or more answers."""
    out: list[Fetched | None] = []
    while len(out) < count:
        msg = next(stream, None)
        part = None if msg is None else msg.WhichOneof("part")
        if part == "headers":
            views = msg.headers  # type: ignore[union-attr]
            if not views or len(out) + len(views) > count:
                raise Corrupt(f"RetrieveMany: a run of {len(views)} headers after {len(out)} "
                              f"of the {count} entries asked for")
            for view in views:
                out.append(_answer(view.head, view.entry, stream))
            continue
        if part != "header":
            got = "nothing" if msg is None else f"a {part}"
            raise Corrupt(f"RetrieveMany: {got} arrived where the header of entry {len(out)} "
                          f"of {count} was due")
        out.append(_answer(msg.header, b"", stream))  # type: ignore[union-attr]
    if next(stream, None) is not None:
        raise Corrupt(f"RetrieveMany: more than the {count} entries asked for")
    return out


def _answer(head: pb.RetrieveHeader, entry: bytes | memoryview, stream: Iterator[Any]
            ) -> Fetched | None:
    """One RetrieveMany answer: None (missing), the entry its header carries, or the one its
    ``frame_count`` next messages bring."""
    if head.missing:
        if len(entry) or head.total_bytes:
            raise Corrupt("RetrieveMany: a missing entry with bytes")
        return None
    if not len(entry):
        return received(head, islice(stream, head.frame_count))
    if len(entry) != head.total_bytes:
        raise Corrupt(f"RetrieveMany: an entry of {len(entry)} bytes under a header of "
                      f"{head.total_bytes}")
    got = _fetched(entry, head.tier, whole=True)  # its header parsed (checked) here
    if len(got.parts.frames) != head.frame_count:
        raise Corrupt(f"RetrieveMany: an entry of {len(got.parts.frames)} frames under a "
                      f"header of {head.frame_count}")
    return got


class DataPlane(PutsMixin):
    def __init__(self, stub: Any, call: Callable[[Callable[[], Any]], Any],
                 metadata: Callable[[str | None], Any], timeout_s: float, shm_bytes: int,
                 max_message_bytes: int, keep_leases_bytes: int | None = None,
                 net_host: str = "", net_tls: Any = None) -> None:
        self._stub = stub
        self._call = call
        self._metadata = metadata
        self.timeout_s = timeout_s
        self.shm_bytes = shm_bytes
        self.keep_leases_bytes = keep_leases_bytes
        self.inline_budget = max(1, min(INLINE_BYTES, max_message_bytes - INLINE_SLACK))
        self.entry_budget = min(INLINE_ENTRY_BYTES, self.inline_budget)
        """Bytes an inline answer carries for an entry asked for alone."""
        self._lock = threading.Lock()
        self._segment: Any = None
        self._arena: Any = None  # kdn.client.shm.LeasedArena, where the server lends one
        self._arena_conn: socket.socket | None = None  # the connection it came on (kept open)
        self._segment_id = ""
        self._tried = shm_bytes <= 0
        self._fast_path = ""
        self._inline_ok = True
        self._conns = threading.local()
        self._too_big: OrderedDict[tuple[str, bytes], None] = OrderedDict()  # inline only
        self._all_conns: list[socket.socket] = []
        self._net_host = net_host  # the server's host for its network data path; "" = none
        self._net_tls = net_tls  # (ssl context, server name) when the channel speaks TLS
        self._net: NetPath | None = None
        self._net_tried = not net_host
        self.server_seals = False
        """The server seals staged entries (``AttachResponse.seals``)."""

    # -- the segment ----------------------------------------------------------------------------

    def segment(self) -> tuple[Any, str]:
        """(segment, id) once attached; (None, "") when the plane runs inline."""
        if self._tried:
            return self._segment, self._segment_id
        with self._lock:
            if not self._tried:
                self._attach()  # a server that can not be reached now raises: ask again later
                self._tried = True
        return self._segment, self._segment_id

    def _attach(self) -> None:
        from kdn.client.shm import SharedSegment

        try:
            seg = SharedSegment(self.shm_bytes)
        except (OSError, ValueError, AttributeError) as exc:  # no memfd on this platform
            log.info("kdn: no shared segment (%s); batches go inline", exc)
            return
        req = pb.AttachRequest(pid=seg.pid, fd=seg.fd, size=seg.size, nonce=seg.nonce)
        md = self._metadata(None)
        try:
            resp = self._call(lambda: self._stub.Attach(req, timeout=self.timeout_s,
                                                        metadata=md))
        except (Unavailable, DeadlineExceeded):
            seg.close()
            raise
        except KDNError as exc:  # another host or container, no permission, an older server
            log.info("kdn: the server can not map this client's memory (%s); using gRPC", exc)
            seg.close()
            return
        self._segment, self._segment_id = seg, resp.segment_id
        self._fast_path = resp.fast_path
        self.server_seals = resp.seals
        if self._fast_path:
            self._arena = self._open_arena()

    def _open_arena(self) -> Any:
        """The server's read arena of this tenant (``kdn.server.arena``), handed over the fast
        path; None where the server keeps none or it can not be mapped (reads then copy)."""
        from kdn.client.shm import LeasedArena

        body = self._segment_id.encode()
        fds: list[int] = []
        ok, body_in = 0, b""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            try:
                conn.settimeout(self.timeout_s)
                conn.connect("\0" + self._fast_path)
                conn.sendall(FAST_HEAD.pack(len(body), FAST_ARENA) + body)
                first, fds, _, _ = socket.recv_fds(conn, FAST_HEAD.size + ARENA_SIZE.size, 1)
                head = first[: FAST_HEAD.size]
                if len(head) < FAST_HEAD.size:
                    head += read_exact(conn, FAST_HEAD.size - len(head)) or b""
                n, ok = FAST_HEAD.unpack(head)
                body_in = first[FAST_HEAD.size :]
                body_in += read_exact(conn, n - len(body_in)) or b""
            finally:
                if ok and len(fds) == 1 and len(body_in) == ARENA_SIZE.size:
                    conn.settimeout(None)  # kept open, blocking: ``_server_alive`` peeks it
                    self._arena_conn = conn
                else:
                    conn.close()
            if not ok or len(fds) != 1 or len(body_in) != ARENA_SIZE.size:
                log.info("kdn: no read arena from the server (%s)",
                         body_in.decode("utf-8", "replace") if not ok else "malformed answer")
                for fd in fds:
                    os.close(fd)
                return None
            (size,) = ARENA_SIZE.unpack(body_in)
            return LeasedArena(fds[0], size, self.keep_leases_bytes)
        except (OSError, ValueError) as exc:
            log.info("kdn: no read arena (%s); reads copy into the segment", exc)
            return None

    def _server_alive(self) -> bool:
        """Whether the server that lent the arena still runs: the connection it was handed
        over on is still open (a server that exited, even killed, closed it). Kept leases of
        a gone server are not read again: a new one knows nothing of its words."""
        conn = self._arena_conn
        if conn is None:
            return False
        try:
            return bool(conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
        except BlockingIOError:
            return True  # open, nothing said: alive
        except OSError:
            return False

    @property
    def attached(self) -> bool:
        return self.segment()[0] is not None

    @property
    def direct(self) -> bool:
        """Batches of any size go without gRPC: through the segment, or the network data
        path (``kdn.client.netpath``)."""
        return self.attached or self.net() is not None

    def _net_get(self, net: NetPath, namespace: str, keys: Sequence[bytes],
                 layout_fingerprint: str) -> list[Fetched | TooBig | None] | None:
        """``get_many`` on the network data path; None when it failed (gRPC then)."""
        try:
            got = net.get_many(namespace, keys, layout_fingerprint)
        except (OSError, NotFound) as exc:
            self._net_lost(exc)
            return None
        return [None if g is None else _fetched(g[0], g[1], owned=True, checked=True)
                for g in got]

    def close(self) -> None:
        seg, seg_id = self._segment, self._segment_id
        self._segment, self._segment_id, self._tried = None, "", True
        if self._arena is not None:  # Detach gives its leases back on the server
            self._arena.close()
            self._arena = None
        if self._arena_conn is not None:
            self._arena_conn.close()
            self._arena_conn = None
        self._fast_path = ""
        for conn in self._all_conns:
            conn.close()
        self._all_conns = []
        net, self._net, self._net_tried = self._net, None, True
        if net is not None:
            net.close()
            seg_id = net.ticket  # given back as a segment is
        if seg is None and net is None:
            return
        try:
            md = self._metadata(None)
            self._call(lambda: self._stub.Detach(pb.DetachRequest(segment_id=seg_id),
                                                 timeout=self.timeout_s, metadata=md))
        except KDNError:
            pass  # the server unmaps it at shutdown anyway
        if seg is not None:
            seg.close()

    # -- reads ----------------------------------------------------------------------------------

    def get_many(self, namespace: str, keys: Sequence[bytes], layout_fingerprint: str,
                 request_id: str | None, *, pinned: bool = False
                 ) -> list[Fetched | TooBig | None]:
        """One entry per key: Fetched, None (a miss), or TOO_BIG (stream it instead).
        ``pinned``: the entries are bound for a CUDA device: a leased entry is then viewed
        read-only through the arena's mapping registered with CUDA (``LeasedArena.view``), so
        the host-to-device copy reads the server's pages with no copy on the host."""
        out: list[Fetched | TooBig | None] = [None] * len(keys)
        todo = list(range(len(keys)))
        seg, seg_id = self.segment()
        net = self.net() if seg is None else None
        if net is not None:
            got = self._net_get(net, namespace, keys, layout_fingerprint)
            if got is not None:
                return got
        if seg is None and not self._inline_ok:
            return [TOO_BIG] * len(keys)
        if seg is None and self._too_big:  # streamed straight away: no call to learn it again
            with self._lock:
                known = [(namespace, keys[i]) in self._too_big for i in todo]
            for i, big in zip(todo, known):
                if big:
                    out[i] = TOO_BIG
            todo = [i for i, big in zip(todo, known) if not big]
        arena = self._arena if seg is not None else None
        if arena is not None and arena.kept_bytes and (arena.pressed() or
                                                       not self._server_alive()):
            arena.forget()  # the arena is full (the leases go back with this call), or the
            # server exited (its words say nothing any more)
        if arena is not None and arena.kept_bytes:  # kept leases still the server's values:
            left = []  # read again without a call
            for i in todo:
                got = arena.reuse((namespace, keys[i], layout_fingerprint), pinned=pinned)
                if got is None:
                    left.append(i)
                    continue
                view, tier = got
                out[i] = _fetched(view, tier, True, True, pinned=view.readonly)
            todo = left
        need = FIRST_REGION  # what the next call's region should hold (sizes learnt so far)
        while todo:
            region = pb.Region(length=self.inline_budget if len(todo) > 1 else self.entry_budget)
            block: tuple[int, int] | None = None
            if seg is not None:
                block = seg.regions.alloc_largest(need)
                if block is None:  # every region is still being read: stream the rest
                    for i in todo:
                        out[i] = TOO_BIG
                    return out
                region = pb.Region(offset=block[0], length=block[1])
            req = pb.GetManyRequest(namespace=namespace, keys=[keys[i] for i in todo],
                                    segment_id=seg_id if seg is not None else "",
                                    region=region, expect_layout_fingerprint=layout_fingerprint)
            if seg is None and len(todo) > 1:  # a batch's large entries stream instead
                req.inline_max_entry_bytes = STREAM_ENTRY_BYTES - 1
            released: list[int] = []
            if arena is not None:
                req.lease = True
                released = arena.take()
                req.release.extend(released)
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
                for i in todo:
                    out[i] = TOO_BIG
                return out
            except BaseException:
                if arena is not None:
                    arena.give_back(released)
                if seg is not None and block is not None:
                    seg.regions.free(*block)
                raise
            unviewed = {ref.lease for ref in resp.entries if ref.lease}
            try:
                again, sizes, used = self._place(resp, todo, out, (namespace, layout_fingerprint),
                                                 keys, seg, block, arena, unviewed, pinned)
            finally:
                if unviewed and arena is not None:  # not handed out: given back with the next
                    arena.give_back(sorted(unviewed))
            if seg is not None and block is not None:
                seg.regions.free(used, block[0] + block[1] - used)
            if seg is None and again:  # inline: large entries the message did not hold
                small = []  # stream (one RetrieveMany for all of them, a message a frame)
                for i, n in zip(again, sizes):
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

    def _place(self, resp: pb.GetManyResponse, todo: list[int],
               out: list[Fetched | TooBig | None], names: tuple[str, str],
               keys: Sequence[bytes],
               seg: Any, block: tuple[int, int] | None, arena: Any, unviewed: set[int],
               pinned: bool = False) -> tuple[list[int], list[int], int]:
        """Hand out one GetMany answer's entries (``out``); (entries to ask again, their sizes,
        end of the region's used part). ``names``: the namespace and the layout fingerprint
        asked for (a kept lease answers only reads that ask the same)."""
        namespace, fingerprint = names
        used = block[0] if block is not None else 0
        again: list[int] = []
        sizes: list[int] = []
        for i, ref in zip(todo, resp.entries):
            if not ref.present:
                continue
            if not ref.written:
                again.append(i)
                sizes.append(ref.length)
                if seg is None and ref.length > self.entry_budget:  # streams when alone
                    self._remember_too_big(namespace, keys[i])
                continue
            if ref.lease:
                if arena is None:
                    raise Corrupt("GetMany answered with a lease this client did not ask for")
                if ref.generation:  # kept before it is viewed: its views then never free it
                    arena.keep((namespace, keys[i], fingerprint), ref.lease, ref.offset,
                               ref.length, ref.generation_at, ref.generation, ref.tier)
                try:
                    view = arena.view(ref.lease, ref.offset, ref.length, pinned=pinned)
                except ValueError as exc:
                    raise Corrupt(f"GetMany: {exc}") from None
                unviewed.discard(ref.lease)
                out[i] = _fetched(view, ref.tier, True, ref.verified, pinned=view.readonly)
            elif seg is not None and block is not None:
                if ref.offset < used or ref.offset + ref.length > block[0] + block[1]:
                    raise Corrupt(f"GetMany placed an entry at [{ref.offset}, "
                                  f"{ref.offset + ref.length}), outside the free part "
                                  f"[{used}, {block[0] + block[1]}) of its region")
                out[i] = _fetched(seg.owned(ref.offset, ref.length, used), ref.tier, True,
                                  ref.verified)
                used = (ref.offset + ref.length + 63) // 64 * 64
            else:
                out[i] = _fetched(ref.data, ref.tier, whole=True)
        return again, sizes, used

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

    def _put(self, req: pb.PutManyRequest, request_id: str | None) -> pb.PutManyResponse:
        return self._many(FAST_PUT_MANY, req, self._stub.PutMany, pb.PutManyResponse,
                          request_id)

    def _many(self, op: int, req: Any, rpc: Callable[..., Any], answer: type[T],
              request_id: str | None) -> T:
        """One GetMany / PutMany: on the fast path when there is one, else by gRPC."""
        if req.segment_id and self._fast_path:
            out = self._fast(op, req)
            if out is not None:
                return answer.FromString(out)  # type: ignore[attr-defined, no-any-return]
        md = self._metadata(request_id)
        return self._call(  # type: ignore[no-any-return]
            lambda: rpc(req, timeout=self.timeout_s, metadata=md))

    def _fast(self, op: int, req: pb.GetManyRequest | pb.PutManyRequest) -> bytes | None:
        """One call on this thread's fast-path connection (``kdn.server.fastpath``); None when
        the path is gone (the call then goes by gRPC, and so do later ones)."""
        try:
            conn = self._fast_conn()
            fast_send(conn, op, req)
            ok, out = fast_answer(conn)
        except OSError as exc:
            self._fast_lost(exc)
            return None
        if not ok:
            raise fast_error(out)
        return out

    def _fast_conn(self, *, settle: bool = True) -> socket.socket:
        """This thread's fast-path connection (calls on it are answered in order; with
        ``settle``, after this thread's asynchronous stores' answers are read)."""
        if settle and self.has_pending():
            self.settle_async()
        conn: socket.socket | None = getattr(self._conns, "conn", None)
        if conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                conn.settimeout(self.timeout_s)
                conn.connect("\0" + self._fast_path)
            except OSError:
                conn.close()
                raise
            self._conns.conn = conn
            self._all_conns.append(conn)
        return conn

    def _fast_lost(self, exc: OSError) -> None:
        log.info("kdn: fast path unusable (%s); using gRPC", exc)
        self._fast_path = ""
        conn = getattr(self._conns, "conn", None)
        if conn is not None:
            conn.close()
        self._conns.conn = None
