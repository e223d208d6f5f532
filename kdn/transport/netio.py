"""Containers read off a socket and checked as they land (the network data path's two sides,
``kdn.server.netpath`` and ``kdn.client.netpath``)."""

from __future__ import annotations

import socket
from collections.abc import Callable

from kdn.codec.format import (
    FRAME_PREFIX_BYTES,
    HEAD_PREFIX_BYTES,
    Header,
    frame_length,
    header_size,
    parse_header,
)
from kdn.errors import Corrupt, KDNError, Truncated, kept
from kdn.transport.wire import recv_into_all

READ_AHEAD = 1 << 20
"""Bytes read past what the next check needs, at least (small frames are checked a run at a
time, not each after reads of its own; a run still fits the cache)."""


def recv_container(conn: socket.socket, view: memoryview, at: int,
                   check: Callable[[Header, int, memoryview], object]) -> KDNError | None:
    """Fill ``view`` (one container; its first ``at`` bytes are there already) from ``conn``,
    checking it as its parts land: each frame, with ``check(header, index, frame)``, as soon
    as its last byte arrived (reads run up to ``READ_AHEAD`` past it, so a frame is checked
    while in cache). The first fault, or None. Every byte of ``view`` is read either way (the
    rest unchecked once a fault is found), so the connection stays in step; OSError when it
    closed first."""
    n = len(view)

    def need(end: int) -> None:  # bytes up to ``end`` read (and a run more, if it is short)
        nonlocal at
        if end <= at:
            return
        end = min(n, max(end, at + READ_AHEAD))
        if not recv_into_all(conn, view[at:end]):
            raise OSError("the data path closed inside an entry")
        at = end

    try:
        need(min(HEAD_PREFIX_BYTES, n))
        head = header_size(view[:at])
        if head > n:
            raise Truncated(f"an entry of {n} bytes can not hold its {head}-byte header")
        need(head)
        header = parse_header(view[:head])
        pos = head
        for index in range(len(header.entry.frames)):
            if pos + FRAME_PREFIX_BYTES > n:
                raise Truncated(f"frame {index} begins past the entry's {n} bytes")
            need(pos + FRAME_PREFIX_BYTES)
            end = pos + frame_length(view, pos)
            if end > n:
                raise Corrupt(f"frame {index} ends past the entry's {n} bytes")
            need(end)
            check(header, index, view[pos:end])
            pos = end
        if pos != n:
            raise Corrupt(f"{n - pos} bytes after the entry's last frame")
        return None
    except KDNError as exc:
        if at < n and not recv_into_all(conn, view[at:]):
            raise OSError("the data path closed inside an entry") from None
        return kept(exc)  # data to its caller: not the frames (``view`` among them) it passed
