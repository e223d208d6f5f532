"""The waits of a layer stream: a timeout bounds the whole call (``LayerStream.result``
waits for its reader and then for each layer, all within it); streams let go leave the
others of their call whole."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import pytest

from kdn.client import Client, netpath, stream
from kdn.client.landing import PendingStream
from kdn.client.stream import LayerStream, StreamTimings
from kdn.codec import StreamDecoder, encode_parts
from kdn.errors import Cancelled, Unavailable
from kdn.server import ServerThread
from kdn.transport.wire import Frame, FrameMessage
from tests.helpers import numbered_key, random_kv, uniform_layout


def _slow_stream(layers: int, gap_s: float, sent: list[int] | None = None) -> LayerStream:
    """A stream whose link brings one frame (one layer) every ``gap_s`` seconds (their
    indexes appended to ``sent``)."""
    parts = encode_parts(random_kv(uniform_layout(layers=layers), tokens=16), "lossless",
                         layers_per_frame=1)

    def frames() -> Iterator[FrameMessage]:
        for i, f in enumerate(parts.frames):
            time.sleep(gap_s)
            if sent is not None:
                sent.append(i)
            yield FrameMessage(Frame(i, bytes(f)))

    return LayerStream(StreamDecoder(parts.header), frames(), "ram", lambda: None,
                       StreamTimings())


def test_result_times_out_once_its_timeout_is_spent_not_once_per_layer() -> None:
    """It gave the reader's join the timeout, then each layer's wait a fresh one: 8 frames
    0.3 s apart, ``result(timeout=0.5)`` returned after 2.4 s."""
    stream = _slow_stream(layers=8, gap_s=0.3)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="after 0.5 s"):
        stream.result(timeout=0.5)
    assert time.monotonic() - t0 < 1.0
    stream.cancel()


def test_a_wait_too_long_for_threading_is_a_wait_without_end() -> None:
    """wait_for_layer(i, 1e10) (vLLM's worker passes its config's timeout_s) raised a raw
    OverflowError, past threading.TIMEOUT_MAX, for each layer not landed yet."""
    s = _slow_stream(layers=3, gap_s=0.05)
    assert len(s.wait_for_layer(2, 1e10)) == 2
    assert len(s.result(timeout=1e10).layers) == 3
    entry: Future[Any] = Future()  # an entry still landing on the network data path
    pending = PendingStream(entry, "ram", "cpu", StreamTimings())
    threading.Timer(0.05, entry.set_exception, (Unavailable("connection dropped"),)).start()
    with pytest.raises(Unavailable, match="connection dropped"):
        pending.wait_for_layer(0, 1e10)


def test_a_cancelled_stream_decodes_no_more_of_its_frames() -> None:
    """A stream whose call cancel does not stop (same-host frames, already in memory) went
    on decoding every frame on its reader thread, also at exit, under the interpreter's
    finalizing (the process aborted: 'terminate called without an active exception')."""
    sent: list[int] = []
    s = _slow_stream(layers=20, gap_s=0.05, sent=sent)
    s.wait_for_layer(0, timeout=10)
    s.cancel()
    assert s._reader is not None
    s._reader.join(10)
    assert len(sent) < 5
    with pytest.raises(Cancelled):
        s.wait_for_layer(19, timeout=1)


def test_at_exit_the_streams_still_read_are_stopped_and_their_readers_joined() -> None:
    s = _slow_stream(layers=20, gap_s=0.1)
    s.wait_for_layer(0, timeout=10)
    t0 = time.monotonic()
    stream.stop_readers(wait_s=5)
    assert s._reader is not None and not s._reader.is_alive()
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(Cancelled, match="exiting"):
        s.result(timeout=1)


@pytest.mark.parametrize("connections", [1, 2])
def test_streams_let_go_leave_the_kept_streams_of_their_stripe_whole(
        server: ServerThread, connections: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine keeps the leading streams of a context whose block went missing and lets
    the rest go: each let go shut its stripe's whole connection, and the kept streams on it
    failed (Unavailable: the data path connection dropped inside an entry). The let-go
    entries are read and dropped while a kept one of the stripe is still to come."""
    remote = Client(server.address, timeout_s=30, shm_bytes=0, data_connections=connections)
    layout = uniform_layout(layers=4, heads=2, dim=64)
    kvs = [random_kv(layout, tokens=256, seed=i) for i in range(8)]
    ks = [numbered_key(i) for i in range(8)]
    remote.store_many([(k, kv) for j, (k, kv) in enumerate(zip(ks, kvs)) if j != 3],
                      mode="raw")
    remote.flush()
    gate = threading.Event()
    real = netpath.read_entry

    def held(*args: Any) -> Any:  # no entry lands before the streams are let go
        assert gate.wait(10)
        return real(*args)

    monkeypatch.setattr(netpath, "read_entry", held)
    streams = remote.retrieve_streams(ks)
    assert streams[3] is None
    for s in [streams[0], *streams[4:]]:
        assert s is not None
        s.cancel()
    gate.set()
    for j in (1, 2):
        s = streams[j]
        assert s is not None
        assert s.result(timeout=10).equal(kvs[j])
    again = remote.retrieve_streams(ks[5:6])[0]  # the path goes on
    assert again is not None and again.result(timeout=10).equal(kvs[5])
    remote.close()
