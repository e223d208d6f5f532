"""The framing of the data paths' calls (the same-host fast path, ``kdn.server.fastpath``, and
the network data path, ``kdn.server.netpath``): a request is a u32 body length and a u8 op,
then the body; an answer a u32 body length and a u8 ok (1) or error (0), then the body (an
error: its kind and message, NUL between); the network data path's streamed PutMany (its
items' bytes after the request) and GetMany answers (entries after the answer, each landed and
checked as it arrives)."""

from __future__ import annotations

import select
import socket
import ssl
from collections.abc import Sequence
from typing import Any, TypeVar

from google.protobuf.message import DecodeError, Message

from kdn.client.received import MAX_ENTRY_BYTES
from kdn.codec import EncodedParts
from kdn.codec.format import (
    HEAD_PREFIX_BYTES,
    MAX_HEADER_BYTES,
    check_frame_prefix,
    header_size,
)
from kdn.errors import Corrupt, InvalidArgument, KDNError, TooLarge
from kdn.layout import Expected
from kdn.status import error_of
from kdn.transport.buffers import RECEIVED, BufferPool
from kdn.transport.netio import recv_container
from kdn.transport.wire import FAST_HEAD, read_exact, recv_into_all
from kdn.v1 import kdn_pb2 as pb

M = TypeVar("M", bound=Message)


def fast_send(conn: socket.socket, op: int, req: Any) -> None:
    body = req.SerializeToString()
    conn.sendall(FAST_HEAD.pack(len(body), op) + body)


MAX_ANSWER_BYTES = 256 << 20
"""Largest answer body a data-path call takes (entry refs, an error's text: the entries' bytes
follow it, bounded on their own, ``MAX_ENTRY_BYTES``); a larger declared one is damage or a
hostile peer, refused before it is read."""
REF_BYTES = 256
"""Bytes one key's ``EntryRef`` (one item's ``StoreResponse``) takes in an answer at most,
its inline entry aside: about 60 today, the rest room for fields a newer server adds."""
ANSWER_SLACK = 64 << 10
"""Bytes an answer may hold besides its keys' (an error's text)."""


def answer_bound(count: int, inline: int = 0) -> int:
    """The largest answer body a call of ``count`` keys (or items) can bring: ``REF_BYTES``
    each, and ``inline`` more each where small entries come inside the answer
    (``GetManyRequest.inline_below_bytes``), ``ANSWER_SLACK`` besides; at most
    ``MAX_ANSWER_BYTES``. A larger one is not read: parsed, a body of empty entries takes
    ~50 times its size."""
    return min(MAX_ANSWER_BYTES, count * (REF_BYTES + inline) + ANSWER_SLACK)


def fast_answer(conn: socket.socket, most: int = MAX_ANSWER_BYTES) -> tuple[int, bytes]:
    """(ok, body) of the next answer on a fast-path connection; OSError when it closed or
    declared an answer past ``most`` bytes (``answer_bound``; the connection is not usable
    after it)."""
    head = read_exact(conn, FAST_HEAD.size)
    if head is None:
        raise OSError("the server closed the data path connection")
    n, ok = FAST_HEAD.unpack(head)
    if n > most:
        raise OSError(f"the data path declared an answer of {n} bytes (at most {most} for "
                      "the call)")
    out = read_exact(conn, n)
    if out is None:
        raise OSError("the server closed the data path connection")
    return ok, out


def parsed(kind: type[M], body: bytes) -> M:
    """The answer ``body`` read as a ``kind`` message; Corrupt where it is not one (a damaged
    or hostile answer: the call is over, answered)."""
    try:
        return kind.FromString(body)
    except DecodeError as exc:
        raise Corrupt(f"the data path answered a {kind.DESCRIPTOR.name} that is not a "
                      f"valid message ({exc})") from None


def fast_error(out: bytes) -> KDNError:
    name, _, message = out.decode("utf-8", "replace").partition("\0")
    return error_of(name, message)


FRAME_ALIGN = 64
"""A read entry's first frame starts at a multiple of this (``kdn.codec.inplace``)."""
BATCH_ITEMS = 4096
"""Items one PutMany carries at most: its request (~60 bytes an item) stays within what the
server reads before a connection's ticket is known (``kdn.server.netpath.FIRST_BODY``)."""
def streamed_put(namespace: str, segment_id: str,
                 items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]]
                 ) -> tuple[pb.PutManyRequest, list[bytes | memoryview]]:
    """A PutMany whose items' bytes follow it on the connection (``kdn.server.streamed``):
    the request (each item's region: where its bytes lie in what follows) and those pieces."""
    req = pb.PutManyRequest(namespace=namespace, segment_id=segment_id)
    pieces: list[bytes | memoryview] = []
    at = 0
    for key, parts, opts in items:
        item = req.items.add(key=key, options=opts)
        item.region.offset, item.region.length = at, parts.nbytes
        pieces += [parts.header, *parts.frames]
        at += parts.nbytes
    return req, pieces


def get_request(namespace: str, keys: Sequence[bytes], want: Expected, segment_id: str,
                call: int = 0) -> pb.GetManyRequest:
    """A GetMany of ``keys`` on the data path (``call``: the number its stripes share, 0: not
    striped; the server counts them as one answer in its bound of reads being sent)."""
    return pb.GetManyRequest(namespace=namespace, keys=keys, segment_id=segment_id,
                             expect_layout_fingerprint=want.fingerprint,
                             expect_tokens=want.tokens, call=call)


def put_results(answer: bytes, count: int) -> list[pb.StoreResponse]:
    results = list(parsed(pb.PutManyResponse, answer).results)
    if len(results) != count:
        raise Corrupt(f"PutMany answered {len(results)} results for {count} items")
    return results


def batches_of(items: Sequence[tuple[bytes, EncodedParts, pb.StoreOptions]], limit: int
               ) -> list[list[int]]:
    """The items' indices in runs of at most ``limit`` bytes and ``BATCH_ITEMS`` items, in
    order; larger items in none (the caller stores them another way)."""
    out: list[list[int]] = [[]]
    size = 0
    for i, (_, parts, _) in enumerate(items):
        if parts.nbytes > limit:
            continue
        if out[-1] and (size + parts.nbytes > limit or len(out[-1]) >= BATCH_ITEMS):
            out.append([])
            size = 0
        out[-1].append(i)
        size += parts.nbytes
    return [b for b in out if b]


def unusable(conn: socket.socket) -> bool:
    """Whether the idle connection ``conn`` (every answer asked for read) may not carry
    another call: the other end closed it, or sent bytes no call asked for (a server out of
    step: answers do not name their keys, so the next call would take them as its own).
    Asked without waiting and without taking anything."""
    if isinstance(conn, ssl.SSLSocket) and conn.pending():
        return True  # decrypted already, not read
    try:
        poller = select.poll()  # the socket's timeout would make a peek wait
        poller.register(conn.fileno(), select.POLLIN)
        return bool(poller.poll(0))  # its end, or bytes: either way not this call's
    except (OSError, ValueError):  # closed here
        return True


def entry_refs(out: bytes, count: int) -> list[pb.EntryRef]:
    """The entries of a GetMany answer's body for ``count`` keys, each present one placed
    right after the one before in the bytes that follow. Corrupt when they are not."""
    resp = parsed(pb.GetManyResponse, out)
    if len(resp.entries) != count:
        raise Corrupt(f"GetMany answered {len(resp.entries)} entries for {count} keys")
    at = 0
    for ref in resp.entries:
        if not ref.present:
            continue
        if ref.offset != at or ref.length < HEAD_PREFIX_BYTES:
            raise Corrupt(f"GetMany placed an entry of {ref.length} bytes at {ref.offset} "
                          f"of the bytes that follow, not at {at}")
        if ref.length > MAX_ENTRY_BYTES:  # nothing is allocated for it
            raise Corrupt(f"GetMany answered an entry of {ref.length} bytes; no server stores "
                          f"one of more than {MAX_ENTRY_BYTES}")
        at += ref.length
    return list(resp.entries)


def read_entry(conn: socket.socket, length: int, pinned: bool = False,
                pool: BufferPool = RECEIVED) -> memoryview:
    """One entry of ``length`` bytes off ``conn`` into a buffer recycled by ``pool``
    (page-locked where ``pinned``), placed so that its first frame starts at a multiple of
    ``FRAME_ALIGN``, each frame checked the moment its last byte lands, while it is in cache
    (the entry comes back checked: decoding need not hash it again). Corrupt when the header
    or a frame is damaged or they do not add up to ``length``."""
    prefix = bytearray(HEAD_PREFIX_BYTES)
    if not recv_into_all(conn, memoryview(prefix)):
        raise OSError("the data path closed inside a GetMany's entries")
    try:
        head = header_size(memoryview(prefix))
    except InvalidArgument:  # a version this kdn does not read: damage or a newer kdn's
        raise _unread(conn, prefix, length) from None
    try:
        room = pinned_room(length + FRAME_ALIGN) if pinned else pool.take(length + FRAME_ALIGN)
    except MemoryError as exc:
        raise TooLarge(f"no memory for a GetMany entry of {length} bytes ({exc})") from None
    start = -(room.ctypes.data + min(head, length)) % FRAME_ALIGN
    view = memoryview(room)[start : start + length]  # type: ignore[arg-type]
    view[:HEAD_PREFIX_BYTES] = prefix
    fault = recv_container(conn, view, HEAD_PREFIX_BYTES, check_frame_prefix)
    if fault is not None:
        try:
            raise fault
        finally:  # its traceback holds this frame, which would hold it
            del fault
    return view


def _unread(conn: socket.socket, prefix: bytearray, length: int) -> KDNError:
    """The error of an entry whose header (``prefix``: its start) names a version this kdn
    does not read, once as much of it as a header takes at most is read: Corrupt where its
    checksum says it was damaged on the way, else InvalidArgument (a newer kdn's)."""
    rest = bytearray(min(length, HEAD_PREFIX_BYTES + MAX_HEADER_BYTES + 8) - HEAD_PREFIX_BYTES)
    if not recv_into_all(conn, memoryview(rest)):
        raise OSError("the data path closed inside a GetMany's entries")
    try:
        header_size(memoryview(prefix + rest))
    except KDNError as exc:
        return exc
    return Corrupt("a container header that reads two ways")  # (not reached)


def pinned_room(size: int) -> Any:
    """A page-locked uint8 array of ``size`` bytes (torch's caching host allocator: freed
    ones are reused, not registered again); a plain one where CUDA is not there. MemoryError
    where CUDA refuses it (torch raises a RuntimeError: out of page-locked memory)."""
    import torch  # only for entries bound for a CUDA device: torch is loaded then

    if not torch.cuda.is_available():
        return RECEIVED.take(size)
    try:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True).numpy()
    except RuntimeError as exc:  # torch.OutOfMemoryError among them
        raise MemoryError(f"no page-locked memory: {exc}") from None
