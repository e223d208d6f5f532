"""A device decode's check is run once for every stream that shares it, and a thread that asks
for a layer while another thread runs the check waits for its outcome: no layer of a damaged
decode is handed out (``LayerStream._checked``, ``gpu_batch.Decoded.check``)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client.stream import LayerStream
from kdn.codec import StreamDecoder, parse_container
from kdn.codec.gpu_batch import Decoded
from kdn.errors import Corrupt
from kdn.layout import KVLayout, LayerLayout


def _stream(check: Any) -> LayerStream:
    layout = KVLayout("check-model", (LayerLayout(1, 4, 4),) * 2, dtype=torch.float16,
                      head_dim=4)
    kv = KVCache(layout, [(torch.ones(1, 3, 4).half(), torch.ones(1, 3, 4).half())] * 2)
    header = parse_container(codec.encode(kv, "raw")).header
    timings = type("T", (), {})()  # the stream sets what it records on it
    return LayerStream(StreamDecoder(header, "cpu"), iter(()), "ram", lambda: None, timings,
                       "cpu", layers=kv.layers, check=check)


def _race(wait: Any) -> list[str]:
    """Thread A starts the (slow) check by asking for layer 0; thread B asks for layer 1 while
    it runs. What each got."""
    got: list[str] = []

    def ask(i: int) -> None:
        try:
            wait(i)
            got.append(f"layer {i}")
        except Corrupt:
            got.append("Corrupt")

    a = threading.Thread(target=ask, args=(0,))
    a.start()
    time.sleep(0.05)  # A is inside the check
    b = threading.Thread(target=ask, args=(1,))
    b.start()
    a.join(5)
    b.join(5)
    return got


def test_a_second_waiter_gets_the_checks_outcome_not_an_unchecked_layer() -> None:
    runs = []

    def slow_damaged() -> None:
        runs.append(1)
        time.sleep(0.3)
        raise Corrupt("entry: rANS data does not decode")

    stream = _stream(slow_damaged)
    assert _race(stream.wait_for_layer) == ["Corrupt", "Corrupt"]
    assert runs == [1]  # once
    with pytest.raises(Corrupt):
        stream.result()


def test_streams_sharing_a_decoded_check_all_see_its_error() -> None:
    gate = threading.Event()

    def slow_sum() -> None:  # a frame's sum computed beside the kernels, found damaged
        gate.wait(0.3)
        raise Corrupt("frame 0: checksum mismatch")

    done = Decoded([(torch.zeros(1), torch.zeros(1))], waits=[slow_sum])
    streams = [_stream(done.check), _stream(done.check)]
    assert _race(lambda i: streams[i].wait_for_layer(0)) == ["Corrupt", "Corrupt"]
