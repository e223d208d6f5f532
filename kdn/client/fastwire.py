"""The framing of the data paths' calls (the same-host fast path, ``kdn.server.fastpath``, and
the network data path, ``kdn.server.netpath``): a request is a u32 body length and a u8 op,
then the body; an answer a u32 body length and a u8 ok (1) or error (0), then the body (an
error: its kind and message, NUL between)."""

from __future__ import annotations

import socket
from typing import Any

from kdn.errors import KDNError
from kdn.status import error_of
from kdn.transport.wire import FAST_HEAD, read_exact


def fast_send(conn: socket.socket, op: int, req: Any) -> None:
    body = req.SerializeToString()
    conn.sendall(FAST_HEAD.pack(len(body), op) + body)


MAX_ANSWER_BYTES = 256 << 20
"""Largest answer body a data-path call takes (entry refs, an error's text: the entries' bytes
follow it, bounded on their own, ``MAX_ENTRY_BYTES``); a larger declared one is damage or a
hostile peer, refused before it is read."""


def fast_answer(conn: socket.socket) -> tuple[int, bytes]:
    """(ok, body) of the next answer on a fast-path connection; OSError when it closed or
    declared an answer past ``MAX_ANSWER_BYTES`` (the connection is not usable after it)."""
    head = read_exact(conn, FAST_HEAD.size)
    if head is None:
        raise OSError("the fast path closed the connection")
    n, ok = FAST_HEAD.unpack(head)
    if n > MAX_ANSWER_BYTES:
        raise OSError(f"the data path declared an answer of {n} bytes (at most "
                      f"{MAX_ANSWER_BYTES})")
    out = read_exact(conn, n)
    if out is None:
        raise OSError("the fast path closed the connection")
    return ok, out


def fast_error(out: bytes) -> KDNError:
    name, _, message = out.decode("utf-8", "replace").partition("\0")
    return error_of(name, message)
