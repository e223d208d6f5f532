"""The waits of a layer stream: a timeout bounds the whole call (``LayerStream.result``
waits for its reader and then for each layer, all within it)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from kdn.client.stream import LayerStream, StreamTimings
from kdn.codec import StreamDecoder, encode_parts
from kdn.transport.wire import Frame, FrameMessage
from tests.helpers import random_kv, uniform_layout


def _slow_stream(layers: int, gap_s: float) -> LayerStream:
    """A stream whose link brings one frame (one layer) every ``gap_s`` seconds."""
    parts = encode_parts(random_kv(uniform_layout(layers=layers), tokens=16), "lossless",
                         layers_per_frame=1)

    def frames() -> Iterator[FrameMessage]:
        for i, f in enumerate(parts.frames):
            time.sleep(gap_s)
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
