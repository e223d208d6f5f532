"""Frame messages of recently read RAM-tier entries, sent again without building them.

gRPC sends whole ``bytes`` objects, so a Retrieve stream makes one message per frame
(``kdn.wire.frame_message``), a copy of the frame out of the stored entry: on loopback that copy
was an eighth of a remote read (188 MB: 87 ms, 75 ms without it; the bare transport 66 ms).
Entries are read again and again (a popular document's chunks, a shared system prompt), so the
messages of the entries read last are kept here and sent as they are the next time.

A memo is named by the key and the RAM tier's stamp of the value it was built from (the number
of the put that stored it): an overwrite stores a new stamp, so messages of an older value are
never sent; values from other tiers (no stamp of their own until promoted) are not memoised.
Frames are added as they are first sent, so a read of a few layers keeps those layers. Bounded
in bytes (``ServerConfig.wire_memo_bytes``, 0: off), least recently read out first; an entry
larger than the whole budget is not kept. The stream checks nothing here: the client verifies
every frame's checksum as before, and the messages hold the bytes the tier served.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator

from kdn.wire import frame_message


class _Memo:
    __slots__ = ("stamp", "messages", "nbytes")

    def __init__(self, stamp: int, count: int) -> None:
        self.stamp = stamp
        self.messages: list[bytes | None] = [None] * count
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
                 frames: Iterable[tuple[int, bytes | memoryview]]) -> Iterator[bytes]:
        """The serialized frame message of each ``(index, frame)`` of ``skey``'s value
        ``stamp`` (``count`` frames, ``entry_bytes`` in all), built one at a time as the
        stream asks for them, from the memo where it has them (a stamp of 0: never)."""
        memo = self._memo_for(skey, stamp, entry_bytes, count)
        for i, frame in frames:
            msg = memo.messages[i] if memo is not None else None
            if msg is None:
                self.misses += 1
                msg = frame_message(i, frame)
                if memo is not None:
                    self._add(skey, memo, i, msg)
            else:
                self.hits += 1
            yield msg

    def drop(self, skey: bytes) -> None:
        """Forget ``skey``'s messages (deleted or overwritten: their memory is let go now)."""
        with self._lock:
            memo = self._memos.pop(skey, None)
            if memo is not None:
                self._bytes -= memo.nbytes

    def _memo_for(self, skey: bytes, stamp: int, entry_bytes: int,
                  count: int) -> _Memo | None:
        if not stamp or entry_bytes > self.capacity_bytes:
            return None
        with self._lock:
            memo = self._memos.get(skey)
            if memo is not None and memo.stamp == stamp and len(memo.messages) == count:
                self._memos.move_to_end(skey)
                return memo
            if memo is not None:  # an older value's messages
                self._bytes -= memo.nbytes
            memo = self._memos[skey] = _Memo(stamp, count)
            self._memos.move_to_end(skey)
            return memo

    def _add(self, skey: bytes, memo: _Memo, index: int, msg: bytes) -> None:
        with self._lock:
            if self._memos.get(skey) is not memo or memo.messages[index] is not None:
                return  # dropped, replaced or evicted meanwhile; or another stream was first
            memo.messages[index] = msg
            memo.nbytes += len(msg)
            self._bytes += len(msg)
            while self._bytes > self.capacity_bytes:
                victim = next((k for k, m in self._memos.items() if m is not memo), None)
                if victim is None:
                    break  # only this one is left (its messages are a few bytes over)
                self._bytes -= self._memos.pop(victim).nbytes
