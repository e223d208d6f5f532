"""Reads for the streamed answers (Retrieve, RetrieveMany): an entry read from the store, its
read counted as served, and the messages that carry the frames a caller asked for.

A value kept as the frames a Store brought (``kdn.store.framed``) is answered with those very
messages; any other is split into frames whose messages are memoised or built as they are sent
(``kdn.server.wire_memo``).

What answers being sent hold of values read from below the RAM tier is bounded (``Sending``):
a disk or Redis read is a copy of its own for each reader, kept until its answer is sent (a
client that stops reading keeps it until ``idle_timeout_s``), where a RAM-tier hit shares the
value the tier holds. Each answer counts its copies from the read until it ends; the stripes
of one data-path call (``join``) count as one answer where the bound lets the only one in.

No message is larger than the server's ``max_message_bytes`` (``fitted``): a frame that would
be is cut into pieces where the caller reads pieces (it asks for them: ``RetrieveRequest.
piece_bytes``), else the read is refused (TooLarge naming the setting and the entry; a
RetrieveMany reader counts a message a frame): an entry stored under a larger setting stays
readable by ``fetch`` after it is lowered, down to pieces of ``MIN_PIECE_BYTES``.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Iterator

from kdn.codec.format import Header, entry_digest, parse_header, split_frames
from kdn.errors import TooLarge
from kdn.keys import split_store_key
from kdn.layout import Expected
from kdn.server.usage import Usage
from kdn.server.wire_memo import WireMemo
from kdn.store.tiered import FramedHit, Hit, TieredStore
from kdn.transport.wire import MIN_PIECE_BYTES
from kdn.v1 import kdn_pb2 as pb

Answer = tuple[pb.RetrieveHeader, list[tuple[int, bytes | memoryview]], Iterator[list[bytes]]]
"""A streamed entry's answer: its header message, the (index, frame) pairs sent and, for each,
the messages that carry it."""


def expected(request: pb.RetrieveRequest | pb.RetrieveManyRequest | pb.GetManyRequest
             ) -> Expected:
    """What a read request expects of the entries it asks for (its layout, its tokens)."""
    return Expected(request.expect_layout_fingerprint, request.expect_tokens)


class Sending:
    """The bytes of lower-tier copies (values read from below ``store``'s RAM tier) that the
    answers being sent hold, at most ``limit`` at once; an answer that is the only one holding
    any is let in whatever its size (one read of a huge entry always is).

    Each answer is a number (``open``, or ``answer``'s block) whose copies count from their
    read (``hold`` or ``took``) until ``close``; a read for one closed already (its call ended
    while a worker thread read on) is not counted, nor let in. The answers that ``join`` one
    call (the stripes of a data-path GetMany) are one where ``fits`` lets the only one in:
    they never refuse each other, and each still lets its copies go as it is sent."""

    def __init__(self, store: TieredStore, limit: int) -> None:
        first = store.tiers[0] if store.tiers else None
        self._memory = first.name if first is not None and first.in_process else None
        self.limit = limit
        self.nbytes = 0
        """Bytes held now."""
        self._answers: dict[int, int] = {}  # answer -> the bytes it holds
        self._numbers = itertools.count(1)
        self._call_of: dict[int, object] = {}  # answer -> the call it joined
        self._calls: dict[object, set[int]] = {}  # call -> its open answers
        self._lock = threading.Condition()  # notified as answers let go of copies

    def cost(self, hit: Hit | FramedHit) -> int:
        """The bytes an answer holding ``hit`` counts: none for a RAM-tier value (shared)."""
        return 0 if hit.tier == self._memory else len(hit.value)

    def open(self) -> int:
        """A new answer, holding nothing yet."""
        answer = next(self._numbers)
        with self._lock:
            self._answers[answer] = 0
        return answer

    def close(self, answer: int, *_: object) -> None:
        """``answer`` is sent (or dropped): what it holds is let go."""
        with self._lock:
            self.nbytes -= self._answers.pop(answer, 0)
            call = self._call_of.pop(answer, None)
            if call is not None:
                self._calls[call].discard(answer)
                if not self._calls[call]:
                    del self._calls[call]
            self._lock.notify_all()

    def join(self, answer: int, call: object) -> None:
        """``answer`` is part of ``call`` (a stripe of one striped GetMany): the call's open
        answers count as one for ``fits``."""
        with self._lock:
            if answer in self._answers and answer not in self._call_of:
                self._call_of[answer] = call
                self._calls.setdefault(call, set()).add(answer)

    @contextlib.contextmanager
    def answer(self) -> Iterator[int]:
        """An answer (``open``) closed when the block ends."""
        answer = self.open()
        try:
            yield answer
        finally:
            self.close(answer)

    def holds(self, answer: int) -> int:
        """The bytes ``answer`` holds."""
        return self._answers.get(answer, 0)

    def fits(self, answer: int, hit: Hit | FramedHit) -> bool:
        """Whether ``hit`` would be let in for ``answer`` now."""
        own = self._own(answer)
        return own is not None and (self.nbytes <= own
                                    or self.nbytes + self.cost(hit) <= self.limit)

    def _own(self, answer: int) -> int | None:
        """The bytes ``answer`` holds, with the other answers of its call (``join``)."""
        own = self._answers.get(answer)
        if own is not None and (call := self._call_of.get(answer)) is not None:
            own = sum(self._answers.get(a, 0) for a in self._calls.get(call, ()))
        return own

    def took(self, answer: int, hit: Hit | FramedHit, wait_s: float = 0.0) -> bool:
        """Count ``hit``'s copy (``cost``) for ``answer`` until it closes; False (nothing
        counted) past ``limit`` where other answers hold some, or once it closed. ``wait_s``:
        an answer (with its call's) that holds nothing yet waits up to that long for room
        first (it holds nothing another waits for: no two wait on each other)."""
        n = self.cost(hit)
        with self._lock:
            if wait_s > 0 and not self.fits(answer, hit) and not self._own(answer):
                self._lock.wait_for(lambda: self.fits(answer, hit) or self._own(answer) != 0,
                                    wait_s)
            if not self.fits(answer, hit):
                return False
            self._answers[answer] += n
            self.nbytes += n
        return True

    def hold(self, answer: int, hit: Hit | FramedHit, wait_s: float = 0.0) -> None:
        """``took`` (``wait_s``: its wait for room), or TooLarge past the bound."""
        if not self.took(answer, hit, wait_s):
            raise TooLarge(f"this read of {len(hit.value)} bytes from disk or redis: the "
                           f"server is sending {self.nbytes} bytes of such reads already "
                           f"(at most {self.limit}); try again when they are sent")

    def let_go(self, answer: int) -> None:
        """What ``answer`` holds so far is sent: let go, the answer kept open."""
        with self._lock:
            if answer in self._answers:
                self.nbytes -= self._answers[answer]
                self._answers[answer] = 0
                self._lock.notify_all()


class Reader:
    """Entries of ``store`` read for a streamed answer, counted in ``usage``, their messages
    memoised in ``wire_memo``; the copies the answers hold bounded by ``sending``."""

    def __init__(self, store: TieredStore, usage: Usage, wire_memo: WireMemo,
                 sending: Sending, message_bytes: int = 0) -> None:
        self.store = store
        self.usage = usage
        self.wire_memo = wire_memo
        self.sending = sending
        self.message_bytes = message_bytes
        """The largest message sent (the server's ``max_message_bytes``; 0: no bound)."""

    async def read(self, skey: bytes) -> tuple[Hit | FramedHit | None, float]:
        """``skey``'s value (a RAM value checked already on this thread, else through
        ``TieredStore.get`` on a worker thread) and the seconds the read took."""
        started = time.perf_counter()
        hit = self.store.get_in_memory(skey, framed=True) or await asyncio.to_thread(
            self.store.get, skey)
        return hit, time.perf_counter() - started

    def answer(self, skey: bytes, hit: Hit | FramedHit, read_s: float, want: Expected,
               first: int = 0, last: int = 0, piece_bytes: int = 0, cuts: bool = True
               ) -> Answer:
        """A Retrieve answer of ``hit``: its header, the frames of layers [first, last) (0:
        through the last) and their messages (a frame's pieces where ``piece_bytes``), which
        a stream sends one at a time: the messages a Store brought where the value is kept
        as they came, else memoised or built as they are sent (``WireMemo``). ``cuts``: the
        caller reads frames in pieces (``fitted``)."""
        header = self.served(skey, hit, read_s, want)
        return self.frames_answer(skey, hit, header, first, last, piece_bytes, cuts)

    def served(self, skey: bytes, hit: Hit | FramedHit, read_s: float, want: Expected
               ) -> Header:
        """``hit``'s header, its read counted as served; LayoutMismatch when it is not what
        the caller expects (``want``: a layout, a number of tokens)."""
        header = parse_header(hit.value.header if isinstance(hit, FramedHit) else hit.value)
        self.usage.served(skey, hit.value, hit.tier, read_s, header)
        want.check(header.layout, header.entry.tokens)
        return header

    def frames_answer(self, skey: bytes, hit: Hit | FramedHit, header: Header, first: int,
                      last: int, piece_bytes: int, cuts: bool = True) -> Answer:
        """``answer`` of a hit whose read was counted (``served``)."""
        kept = hit.value if isinstance(hit, FramedHit) else None  # as it arrived
        frames: list[bytes | memoryview] = list(
            hit.value.frames if isinstance(hit, FramedHit) else
            split_frames(hit.value, len(header.raw)))
        last = last or header.layout.num_layers
        sel = [
            (i, f) for i, (f, span) in enumerate(zip(frames, header.entry.frames))
            if span.first_layer < last and span.first_layer + span.num_layers > first
        ]
        head = pb.RetrieveHeader(
            container_header=header.raw, total_bytes=len(hit.value), tier=hit.tier,
            frame_count=len(frames), entry_digest=entry_digest(frames))
        piece_bytes = self.fitted(skey, max((len(f) for _, f in sel), default=0),
                                  piece_bytes, cuts)
        memo: Iterator[list[bytes]]
        if kept is not None and kept.messages is not None and piece_bytes <= 0:
            memo = ([kept.messages[i]] for i, _ in sel)  # as they came: nothing to build
        else:
            memo = self.wire_memo.messages(skey, hit.stamp if hit.tier == "ram" else 0,
                                           len(hit.value), len(frames), sel, piece_bytes)
        return head, sel, memo

    def fitted(self, skey: bytes, largest: int, piece_bytes: int, cuts: bool) -> int:
        """The pieces (``piece_bytes``, 0: whole frames) frames of up to ``largest`` bytes
        are sent in so that no message passes ``message_bytes``: those asked for where they
        fit, else pieces of what does fit where the caller reads pieces (``cuts``). TooLarge,
        naming the setting and the entry, where no piece fits (below ``MIN_PIECE_BYTES``) or
        the caller takes whole frames only (a layer stream)."""
        room = self.message_bytes - FRAME_SLACK
        if not self.message_bytes or \
                (largest if piece_bytes <= 0 else min(largest, max(piece_bytes, MIN_PIECE_BYTES))
                 ) <= room:
            return piece_bytes
        if cuts and room >= MIN_PIECE_BYTES:
            return room
        _, ns, key = split_store_key(skey)
        way = (f"pieces of it need a max_message_bytes of at least "
               f"{MIN_PIECE_BYTES + FRAME_SLACK}" if cuts else
               "this read takes whole frames (fetch takes them in pieces)")
        raise TooLarge(f"entry {key.hex()} in {ns!r} has a frame of {largest} bytes, larger "
                       f"than this server's max_message_bytes ({self.message_bytes}); {way}: "
                       "raise max_message_bytes, or read it over the data path")

FRAME_SLACK = 64
"""Bytes of a frame's message besides its data (its index, offset and tags)."""
