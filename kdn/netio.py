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
from kdn.errors import Corrupt, KDNError, Truncated
from kdn.wire import recv_into_all


def recv_container(conn: socket.socket, view: memoryview, at: int,
                   check: Callable[[Header, int, memoryview], object]) -> KDNError | None:
    """Fill ``view`` (one container; its first ``at`` bytes are there already) from ``conn``,
    checking it as its parts land, each frame the moment its last byte arrives (in cache)
    with ``check(header, index, frame)``: the first fault, or None. Every byte of ``view`` is
    read either way (the rest unchecked once a fault is found), so the connection stays in
    step; OSError when it closed first."""

    def fill(end: int) -> None:
        nonlocal at
        if end > at and not recv_into_all(conn, view[at:end]):
            raise OSError("the data path closed inside an entry")
        at = max(at, end)

    n = len(view)
    try:
        fill(min(HEAD_PREFIX_BYTES, n))
        head = header_size(view[:at])
        if head > n:
            raise Truncated(f"an entry of {n} bytes can not hold its {head}-byte header")
        fill(head)
        header = parse_header(view[:head])
        for index in range(len(header.entry.frames)):
            start = at
            if start + FRAME_PREFIX_BYTES > n:
                raise Truncated(f"frame {index} begins past the entry's {n} bytes")
            fill(start + FRAME_PREFIX_BYTES)
            end = start + frame_length(view, start)
            if end > n:
                raise Corrupt(f"frame {index} ends past the entry's {n} bytes")
            fill(end)
            check(header, index, view[start:end])
        if at != n:
            raise Corrupt(f"{n - at} bytes after the entry's last frame")
        return None
    except KDNError as exc:
        fill(n)
        return exc
