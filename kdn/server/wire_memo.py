"""Frame messages of recently read RAM-tier entries, sent again without building them.

gRPC sends whole ``bytes`` objects, so a Retrieve stream makes one message per frame
(``kdn.transport.wire.frame_message``), a copy of the frame out of the stored entry: on loopback
that copy was an eighth of a remote read (188 MB: 87 ms, 75 ms without it; the bare transport
66 ms). Entries are read again and again (a popular document's chunks, a shared system prompt),
so the messages of the entries read last are kept here and sent as they are the next time.

A memo is named by the key and the RAM tier's stamp of the value it was built from (the number
of the put that stored it): an overwrite stores a new stamp, so messages of an older value are
never sent; values from other tiers (no stamp of their own until promoted) are not memoised.
Frames are added as they are first sent, so a read of a few layers keeps those layers. Bounded
in bytes (``ServerConfig.wire_memo_bytes``, 0: off), least recently read out first; an entry
larger than the whole budget is not kept. The stream checks nothing here: the client verifies
every frame's checksum as before, and the messages hold the bytes the tier served.

A memo holds one form of the messages: whole frames, or frames in pieces of one size
(``RetrieveRequest.piece_bytes``); a read asking for another form builds that one in its place.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kdn.transport.wire import piece_messages


class _Memo:
    __slots__ = ("stamp", "piece_bytes", "messages", "nbytes")

    def __init__(self, stamp: int, count: int, piece_bytes: int) -> None:
        self.stamp = stamp
        self.piece_bytes = piece_bytes
        self.messages: list[list[bytes] | None] = [None] * count
        self.nbytes = 0


class WireMemo:
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = max(0, capacity_bytes)
        self._memos: OrderedDict[bytes, _Memo] = OrderedDict()  # least recently read first
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def messages(self, skey: bytes, stamp: int, entry_bytes: int, count: int,
                 frames: Iterable[tuple[int, bytes | memoryview]], piece_bytes: int = 0
                 ) -> Iterator[list[bytes]]:
        """The serialized messages of each ``(index, frame)`` of ``skey``'s value ``stamp``
        (``count`` frames, ``entry_bytes`` in all): one per frame, or its pieces of about
        ``piece_bytes`` (``kdn.transport.wire.piece_messages``); built one frame at a time as the
        stream asks for them, from the memo where it has them (a stamp of 0: never)."""
        memo = self._memo_for(skey, stamp, entry_bytes, count, piece_bytes)
        for i, frame in frames:
            msgs = memo.messages[i] if memo is not None else None
            if msgs is None:
                self.misses += 1
                msgs = piece_messages(i, frame, piece_bytes)
                if memo is not None:
                    self._add(skey, memo, i, msgs)
            else:
                self.hits += 1
            yield msgs

    def drop(self, skey: bytes) -> None:
        """Forget ``skey``'s messages (deleted or overwritten: their memory is let go now)."""
        with self._lock:
            memo = self._memos.pop(skey, None)
            if memo is not None:
                self._bytes -= memo.nbytes

    def _memo_for(self, skey: bytes, stamp: int, entry_bytes: int, count: int,
                  piece_bytes: int) -> _Memo | None:
        if not stamp or entry_bytes > self.capacity_bytes:
            return None
        with self._lock:
            memo = self._memos.get(skey)
            if memo is not None and memo.stamp == stamp and len(memo.messages) == count \
                    and memo.piece_bytes == piece_bytes:
                self._memos.move_to_end(skey)
                return memo
            if memo is not None:  # an older value's messages, or another form of them
                self._bytes -= memo.nbytes
            memo = self._memos[skey] = _Memo(stamp, count, piece_bytes)
            self._memos.move_to_end(skey)
            return memo

    def _add(self, skey: bytes, memo: _Memo, index: int, msgs: list[bytes]) -> None:
        size = sum(len(m) for m in msgs)
        with self._lock:
            if self._memos.get(skey) is not memo or memo.messages[index] is not None:
                return  # dropped, replaced or evicted meanwhile; or another stream was first
            memo.messages[index] = msgs
            memo.nbytes += size
            self._bytes += size
            while self._bytes > self.capacity_bytes:
                victim = next((k for k, m in self._memos.items() if m is not memo), None)
                if victim is None:
                    break  # only this one is left (its messages are a few bytes over)
                self._bytes -= self._memos.pop(victim).nbytes
