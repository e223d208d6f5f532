"""A whole-entry GPU decode is queued on the decoding thread's current stream (a landing
thread's, a codec worker's), while its consumer reads the damage flag and uses the layers on
its own stream (an engine's, often not the default one). The decode records an event after
its kernels (``Decoded.ready``); the check's stream waits for it before reading the flag, and
each consumer stream before using the layers (``landing.decode_ready``: a ``Copy`` that
``LayerStream.wait_for_layer`` waits for). Checked on the CPU with fakes of the event calls;
the real thing on a GPU (``-m gpu``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kdn import codec
from kdn.client import landing, stream
from kdn.codec import entropy, gpu_batch
from kdn.codec.api import layer_spec
from kdn.codec.format import check_frame, parse_container
from kdn.codec.modes import get_mode
from tests.helpers import random_kv, uniform_layout


def _bodies(mode: str, level: str) -> tuple[list[memoryview], list[Any]]:
    blob = codec.encode(random_kv(uniform_layout(layers=3), 24, seed=2), mode, level)
    c = parse_container(blob, verify=False)
    recs = [r for i, f in enumerate(c.frames) for r in check_frame(c.header, i, f)]
    return ([memoryview(r.body) for r in recs],
            [layer_spec(c.header.layout, r.layer, r.tokens) for r in recs])


@pytest.mark.parametrize("mode,level", [("kdn", "default"), ("int8", "")])
def test_a_whole_entry_decode_records_an_event_after_its_launches(
        mode: str, level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without it, a consumer on another stream could read the flag (and pass damaged bytes)
    or the layers before the kernels ran."""
    order: list[str] = []
    monkeypatch.setattr(gpu_batch, "_launch", lambda *a, **k: order.append("launch"))
    monkeypatch.setattr(gpu_batch, "record_ready",
                        lambda device: order.append(f"record {device.type}") or "event")
    bodies, specs = _bodies(mode, level)
    done = get_mode(mode).decode_layers(bodies, specs, level, torch.device("cpu"))
    assert done is not None and done.ready == "event"
    assert order[-1] == "record cpu" and "launch" in order  # after the last launch
    assert done.out is not None and all(  # the one buffer the layers view
        k.untyped_storage().data_ptr() == done.out.untyped_storage().data_ptr()
        for k, _ in done.layers)


def test_the_check_waits_for_the_decode_before_reading_the_flag(
        monkeypatch: pytest.MonkeyPatch) -> None:
    order: list[Any] = []

    class Flag:
        device = torch.device("cpu")

        def item(self) -> int:
            order.append("read flag")
            return 0

    monkeypatch.setattr(gpu_batch, "await_ready",
                        lambda ready, device: order.append(("wait", ready, device.type)))
    done = gpu_batch.Decoded([], Flag(), ready="event")  # type: ignore[arg-type]
    done.check()
    assert order == [("wait", "event", "cpu"), "read flag"]


def test_a_consumer_stream_waits_for_the_decode_of_each_stream_it_uses() -> None:
    """``decode_ready`` is what LayerStream's consumers wait for, once per stream, the layers'
    buffer recorded as used there; nothing where the decode had no event (the CPU)."""
    out = torch.zeros(8)
    got = landing.decode_ready(gpu_batch.Decoded([], None, ready="event", out=out))
    assert isinstance(got, stream.Copy)
    assert got.event == "event" and got.span is out and got.sources == ()
    assert landing.decode_ready(gpu_batch.Decoded([], None)) is None
    assert landing.decode_ready(object()) is None  # a decoder's result of another kind


class _Event:
    def __init__(self) -> None:
        self.recorded_on: Any = None

    def record(self, on: Any) -> None:
        self.recorded_on = on


def test_a_layer_decoded_on_the_device_by_a_worker_is_awaited_by_the_consumer(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Frames decoded on the device by the codec's worker threads (per layer: cachegen,
    format-2 kdn blobs) were handed out as they were, queued on the worker's stream: a
    consumer on its own stream could use them before the kernels ran. Each such layer gets
    an event on the decoding thread's stream, which ``wait_for_layer`` waits for."""
    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")

    class OnGpu:
        device = gpu

    s = stream.LayerStream.__new__(stream.LayerStream)
    s.device, s._copy_stream, s._events = gpu, "copy stream", {}  # noqa: SLF001
    k, v = OnGpu(), OnGpu()
    assert s._place(3, k, v) == (k, v)  # type: ignore[arg-type]  # noqa: SLF001
    staged = s._events[3]  # noqa: SLF001
    assert staged.event.recorded_on == "stream of cuda:0" and staged.sources == ()
    ready = stream.Copy("the decode's event", ())
    s._events[4] = ready  # noqa: SLF001
    s._place(4, k, v)  # type: ignore[arg-type]  # noqa: SLF001
    assert s._events[4] is ready  # a whole-entry decode's event is not replaced  # noqa: SLF001
    cpu = stream.LayerStream.__new__(stream.LayerStream)
    cpu.device, cpu._copy_stream, cpu._events = torch.device("cpu"), None, {}  # noqa: SLF001
    t = torch.zeros(2)
    cpu._place(0, t, t)  # noqa: SLF001
    assert cpu._events == {}  # nothing to wait for on the CPU  # noqa: SLF001


def test_codec_decode_waits_for_each_workers_stream_on_the_callers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``codec.decode`` of an entry decoded layer by layer on the codec's threads returned the
    layers queued on those threads' streams; the caller's stream now waits for each."""
    from kdn.codec import gpu_source

    made: list[str] = []
    awaited: list[str] = []
    lock = threading.Lock()

    def record(device: torch.device) -> str:
        with lock:
            made.append(f"{threading.current_thread().name} on {device.type}")
            return made[-1]

    monkeypatch.setattr(gpu_source, "record_ready", record)
    monkeypatch.setattr(gpu_source, "await_ready",
                        lambda ready, device: awaited.append((ready, threading.current_thread())))
    blob = codec.encode(random_kv(uniform_layout(layers=4), 16, seed=1), "kdn", "default")
    want = codec.decode(blob)
    made.clear()
    awaited.clear()
    assert codec.decode(blob, device="cpu", batched=False).equal(want)
    assert len(made) == 4 and sorted(made) == sorted(r for r, _ in awaited)
    assert all(t is threading.main_thread() for _, t in awaited)  # on the caller's stream


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_frames_decoded_by_workers_are_right_on_a_non_default_stream() -> None:
    """The real thing, per layer: a ``kdn`` entry in blob format 2 read frame by frame by a
    LayerStream (each frame decoded on the GPU by a codec worker), its layers used on a
    non-default stream of this thread."""
    from kdn.codec import StreamDecoder
    from kdn.transport.wire import Frame, FrameMessage

    kv = random_kv(uniform_layout(layers=3), 40, seed=5)
    with entropy.writing_format(2):
        blob = codec.encode(kv, "kdn", "default", layers_per_frame=1)
    want = codec.decode(blob).layers
    c = parse_container(blob)
    frames = iter([FrameMessage(Frame(i, bytes(f))) for i, f in enumerate(c.frames)])
    got = stream.LayerStream(StreamDecoder(c.header, "cuda"), frames, "ram", lambda: None,
                             stream.StreamTimings(), "cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        copies = [tuple(t.cpu() for t in got.wait_for_layer(i)) for i in range(len(want))]
    for (kc, vc), (kg, vg) in zip(want, copies, strict=True):
        torch.testing.assert_close(kg, kc)
        torch.testing.assert_close(vg, vc)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode,level", [("kdn", "default"), ("int8", "")])
def test_layers_decoded_on_another_thread_are_right_on_a_non_default_stream(
        mode: str, level: str) -> None:
    """The real thing: an entry decoded whole on a worker thread (its default stream), checked
    and used on a non-default stream of this thread: the CPU's tensors."""
    bodies, specs = _bodies(mode, level)
    want = codec.decode(codec.encode(random_kv(uniform_layout(layers=3), 24, seed=2), mode,
                                     level)).layers
    made: list[Any] = []
    worker = threading.Thread(target=lambda: made.append(get_mode(mode).decode_layers(
        bodies, specs, level, torch.device("cuda"))))
    worker.start()
    worker.join()
    done = made[0]
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        layers = done.check()
        copies = [(k.cpu(), v.cpu()) for k, v in layers]
    for (kc, vc), (kg, vg) in zip(want, copies, strict=True):
        assert torch.equal(kc, kg) and torch.equal(vc, vg)
