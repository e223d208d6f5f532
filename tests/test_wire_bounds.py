"""Lengths a peer declares on the data paths' sockets allocate nothing before the bytes come:
``read_exact`` grows with what arrived, and a network data path answer past its bound is
refused before it is read (a forged 4 GiB length must not reserve 4 GiB)."""

from __future__ import annotations

import socket
import threading
import tracemalloc

import pytest

from kdn.client.fastwire import MAX_ANSWER_BYTES, fast_answer
from kdn.transport.wire import FAST_HEAD, read_exact


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    return a, b


def test_read_exact_allocates_what_arrived_not_what_was_declared() -> None:
    a, b = _pair()
    try:
        b.sendall(b"x" * 1000)
        b.close()
        tracemalloc.start()
        try:
            got = read_exact(a, 1 << 30)  # declared 1 GiB, 1,000 bytes sent, then closed
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert got is None
        assert peak < 8 << 20, f"read_exact reserved {peak} bytes for 1,000 that came"
    finally:
        a.close()


def test_read_exact_reads_a_body_larger_than_one_step() -> None:
    a, b = _pair()
    data = bytes(range(256)) * ((3 << 20) // 256 + 7)  # past READ_STEP, not a multiple
    sender = threading.Thread(target=b.sendall, args=(data,))
    sender.start()
    try:
        assert read_exact(a, len(data)) == data
    finally:
        sender.join()
        a.close()
        b.close()


def test_fast_answer_refuses_a_forged_length_before_reading() -> None:
    a, b = _pair()
    try:
        b.sendall(FAST_HEAD.pack(0xFFFFFFFF, 1))  # then nothing: a read would wait or reserve
        tracemalloc.start()
        try:
            with pytest.raises(OSError, match="declared an answer of 4294967295 bytes"):
                fast_answer(a)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20
    finally:
        a.close()
        b.close()


def test_fast_answer_reads_a_legitimate_answer() -> None:
    a, b = _pair()
    try:
        b.sendall(FAST_HEAD.pack(5, 1) + b"hello")
        assert fast_answer(a) == (1, b"hello")
        assert MAX_ANSWER_BYTES >= 64 << 20  # every legitimate answer (entry refs) fits
    finally:
        a.close()
        b.close()
