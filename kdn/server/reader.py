"""Reads for the streamed answers (Retrieve, RetrieveMany): an entry read from the store, its
read counted as served, and the messages that carry the frames a caller asked for.

A value kept as the frames a Store brought (``kdn.store.framed``) is answered with those very
messages; any other is split into frames whose messages are memoised or built as they are sent
(``kdn.server.wire_memo``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

from kdn.codec.format import Header, entry_digest, parse_header, split_frames
from kdn.layout import Expected
from kdn.server.usage import Usage
from kdn.server.wire_memo import WireMemo
from kdn.store.tiered import FramedHit, Hit, TieredStore
from kdn.v1 import kdn_pb2 as pb

Answer = tuple[pb.RetrieveHeader, list[tuple[int, bytes | memoryview]], Iterator[list[bytes]]]
"""A streamed entry's answer: its header message, the (index, frame) pairs sent and, for each,
the messages that carry it."""


def expected(request: pb.RetrieveRequest | pb.RetrieveManyRequest | pb.GetManyRequest
             ) -> Expected:
    """What a read request expects of the entries it asks for (its layout, its tokens)."""
    return Expected(request.expect_layout_fingerprint, request.expect_tokens)


class Reader:
    """Entries of ``store`` read for a streamed answer, counted in ``usage``, their messages
    memoised in ``wire_memo``."""

    def __init__(self, store: TieredStore, usage: Usage, wire_memo: WireMemo) -> None:
        self.store = store
        self.usage = usage
        self.wire_memo = wire_memo

    async def read(self, skey: bytes) -> tuple[Hit | FramedHit | None, float]:
        """``skey``'s value (a RAM value checked already on this thread, else through
        ``TieredStore.get`` on a worker thread) and the seconds the read took."""
        started = time.perf_counter()
        hit = self.store.get_in_memory(skey, framed=True) or await asyncio.to_thread(
            self.store.get, skey)
        return hit, time.perf_counter() - started

    def answer(self, skey: bytes, hit: Hit | FramedHit, read_s: float, want: Expected,
               first: int = 0, last: int = 0, piece_bytes: int = 0) -> Answer:
        """A Retrieve answer of ``hit``: its header, the frames of layers [first, last) (0:
        through the last) and their messages (a frame's pieces where ``piece_bytes``), which
        a stream sends one at a time: the messages a Store brought where the value is kept
        as they came, else memoised or built as they are sent (``WireMemo``)."""
        header = self.served(skey, hit, read_s, want)
        return self.frames_answer(skey, hit, header, first, last, piece_bytes)

    def served(self, skey: bytes, hit: Hit | FramedHit, read_s: float, want: Expected
               ) -> Header:
        """``hit``'s header, its read counted as served; LayoutMismatch when it is not what
        the caller expects (``want``: a layout, a number of tokens)."""
        header = parse_header(hit.value.header if isinstance(hit, FramedHit) else hit.value)
        self.usage.served(skey, hit.value, hit.tier, read_s, header)
        want.check(header.layout, header.entry.tokens)
        return header

    def frames_answer(self, skey: bytes, hit: Hit | FramedHit, header: Header, first: int,
                      last: int, piece_bytes: int) -> Answer:
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
        memo: Iterator[list[bytes]]
        if kept is not None and kept.messages is not None and piece_bytes <= 0:
            memo = ([kept.messages[i]] for i, _ in sel)  # as they came: nothing to build
        else:
            memo = self.wire_memo.messages(skey, hit.stamp if hit.tier == "ram" else 0,
                                           len(hit.value), len(frames), sel, piece_bytes)
        return head, sel, memo
