"""CUDA work goes to the device of its tensors, never to whatever device is current: a model on
cuda:1 in a process (or thread: the current device is per thread) whose current device is
cuda:0, as in a tensor-parallel worker that never calls ``torch.cuda.set_device``, or a worker
thread of one that does. Checked on the CPU by fakes of a host with two GPUs that record the
device each call is made on (``torch.cuda.device``, ``torch.cuda.Stream``,
``cudaHostRegister``); the real thing where a host has two GPUs (``-m gpu``)."""

from __future__ import annotations

import contextlib
import fcntl
import gc
import os
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.client import landing, stream
from kdn.client.local import LocalTier
from kdn.client.shm import LeasedArena, SharedSegment
from kdn.codec import entropy
from kdn.codec.api import target_device
from tests.helpers import random_kv, uniform_layout


@dataclass
class TwoGPUs:
    """``torch.cuda``'s device calls on a host with two GPUs, cuda:0 current, contexts only on
    the devices in ``contexts``; ``cudaHostRegister`` / ``cudaHostUnregister`` recorded with
    the device current when each was called."""

    contexts: set[int] = field(default_factory=lambda: {1})
    current: int = 0
    calls: list[tuple[str, int, int]] = field(default_factory=list)
    """(call, pointer, current device) of each runtime call."""

    @contextlib.contextmanager
    def device(self, d: Any) -> Iterator[None]:
        index = d if isinstance(d, int) else torch.device(d).index
        before, self.current = self.current, self.current if index is None else index
        try:
            yield
        finally:
            self.current = before

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, self.current))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, self.current))
        return 0

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(torch.cuda, "device", self.device)
        monkeypatch.setattr(torch.cuda, "cudart", lambda: self)
        monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda i: i in self.contexts,
                            raising=False)


@dataclass
class OnCuda1:
    """What a launch reads of a tensor on cuda:1: its device."""

    device: torch.device = torch.device("cuda", 1)


class RecordingKernel:
    """A Triton kernel's launch (``kernel[grid](*args)``) that records the current device."""

    def __init__(self, gpus: TwoGPUs) -> None:
        self.gpus, self.launched_on = gpus, []

    def __getitem__(self, grid: tuple[int, ...]) -> Any:
        return lambda *args, **meta: self.launched_on.append(self.gpus.current)


def test_whole_entry_kernels_launch_on_their_tensors_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Triton launches on the current device: cuda:0 refuses cuda:1's pointers, or with peer
    access runs the decode there, unordered with the copies queued on cuda:1."""
    from kdn.codec import gpu_batch

    gpus = TwoGPUs()
    gpus.install(monkeypatch)
    kernel = RecordingKernel(gpus)
    gpu_batch._launch(kernel, (3,), OnCuda1(), 7, BLOCK=64)
    gpu_batch._launch(kernel, (0,), OnCuda1())  # an empty grid launches nothing
    gpu_batch._launch(kernel, (2,), torch.zeros(1))  # the interpreter's CPU tensors: as is
    assert kernel.launched_on == [1, 0]
    assert gpus.current == 0  # the caller's current device again


def test_the_per_layer_gpu_decoder_launches_through_the_device_guard(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``gpu.decode_on`` (a layer's symbols on a GPU, often on a worker thread, whose current
    device is cuda:0 whatever the engine set) launches as the whole-entry kernels do."""
    from kdn.codec import gpu

    launched: list[Any] = []
    monkeypatch.setattr(gpu, "launch", lambda kernel, grid, *args, **meta: launched.append(
        (kernel, grid, args[0].device)))
    sym = np.arange(40, dtype=np.int32).reshape(4, 10) % 7
    out = gpu.decode_on(entropy.encode_streams(sym, fmt=2), 4, 10, torch.device("cpu"))
    assert out.shape == (4, 10)
    assert launched == [(gpu._decode_kernel, (1,), torch.device("cpu"))]


def _sealed_arena(size: int) -> LeasedArena:
    fd = os.memfd_create("kdn-test-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0x0010 | fcntl.F_SEAL_SHRINK)  # F_SEAL_FUTURE_WRITE
    return LeasedArena(fd, size)


@pytest.mark.parametrize("contexts,on", [({1}, 1), ({0, 1}, 0), (set(), 0)],
                         ids=["only-cuda1-has-one", "current-has-one", "none-has-one"])
@pytest.mark.parametrize("holder", ["segment", "arena", "local-tier"])
def test_host_memory_is_page_locked_on_a_device_that_has_a_context(
        monkeypatch: pytest.MonkeyPatch, holder: str, contexts: set[int], on: int) -> None:
    """``cudaHostRegister`` makes the current device's context where it has none: a process
    on cuda:1 with cuda:0 current held hundreds of MiB on cuda:0, another rank's GPU. It is
    made on the current device where that has a context, else on one that has."""
    gpus = TwoGPUs(contexts=set(contexts))
    gpus.install(monkeypatch)
    if holder == "local-tier":
        parts = codec.encode_parts(random_kv(uniform_layout(), 20), "raw")
        tier = LocalTier(4 * parts.nbytes)
        tier.put("ns", b"k" * 32, parts)
        tier.discard("ns", b"k" * 32)
        gc.collect()  # the entry's finalizer unregisters it
    else:
        held = SharedSegment(1 << 20) if holder == "segment" else _sealed_arena(1 << 20)
        assert held.register_with_cuda() and held.register_with_cuda()  # once
        held.close()
    assert [(c[0], c[2]) for c in gpus.calls] == [("register", on), ("unregister", on)]
    assert gpus.calls[0][1] == gpus.calls[1][1]
    assert gpus.current == 0


def test_a_side_stream_of_the_current_device_is_that_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``side_stream(torch.device("cuda"))`` with cuda:1 current: cuda:1's stream, not one
    filed under cuda:0 that a later cuda:0 retrieve would copy on."""
    made: list[torch.device] = []

    class Stream:
        def __init__(self, device: torch.device) -> None:
            made.append(device)
            self.device = device

    monkeypatch.setattr(stream, "_SIDE", {})
    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    current = stream.side_stream(torch.device("cuda"))
    first = stream.side_stream(torch.device("cuda", 0))
    assert current.device == torch.device("cuda", 1)
    assert first.device == torch.device("cuda", 0)
    assert stream.side_stream(torch.device("cuda", 1)) is current
    assert made == [torch.device("cuda", 1), torch.device("cuda", 0)]


def _current_device_per_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.cuda.current_device`` as CUDA keeps it, per thread: cuda:1 on this one (it set
    it), cuda:0 on any other."""
    main = threading.get_ident()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device",
                        lambda: 1 if threading.get_ident() == main else 0)


def _on_a_thread(fn: Any) -> None:
    worker = threading.Thread(target=fn)
    worker.start()
    worker.join()


def test_cuda_without_an_index_is_the_naming_threads_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """"cuda" resolved where the tensors are made (a decoder's worker thread, the network
    path's) was that thread's current device, cuda:0, not the caller's cuda:1."""
    _current_device_per_thread(monkeypatch)
    assert target_device("cuda", here=False) == torch.device("cuda", 1)
    assert target_device(torch.device("cuda"), here=False) == torch.device("cuda", 1)
    elsewhere: list[torch.device] = []
    _on_a_thread(lambda: elsewhere.append(target_device("cuda", here=False)))
    assert elsewhere == [torch.device("cuda", 0)]  # each thread's own, none memoised
    assert target_device("cuda", here=False) == torch.device("cuda", 1)
    assert target_device("cuda:0", here=False) == torch.device("cuda", 0)  # named: kept
    assert target_device(None) == torch.device("cpu")


def test_an_entry_landing_on_another_thread_goes_to_the_callers_device(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A network hit (``PendingStream``) is made into a stream on the thread that received
    it: ``retrieve_streams(device="cuda")`` from a thread on cuda:1 put its in-process hits
    on cuda:1 and its network hits on cuda:0."""
    _current_device_per_thread(monkeypatch)
    given: list[Any] = []
    monkeypatch.setattr(landing, "stream_of",
                        lambda got, device, timings: given.append(device) or got)
    entry: Future[Any] = Future()
    pending = landing.PendingStream(entry, "ram", "cuda", landing.new_timings())
    fetched = object()
    _on_a_thread(lambda: entry.set_result(fetched))  # its callbacks run on that thread
    assert pending.landed(timeout=5) is fetched
    assert given == [torch.device("cuda", 1)]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("mode,level,batched", [("kdn", "default", None), ("int8", "", None),
                                                ("kdn", "default", False)],
                         ids=["kdn-whole-entry", "int8-whole-entry", "kdn-per-layer"])
def test_an_entry_decodes_on_cuda1_with_cuda0_current_from_any_thread(
        mode: str, level: str, batched: bool | None) -> None:
    """The real thing: an entry decoded on cuda:1 from this thread (cuda:0 current) and from
    a new thread, equal to the CPU's decode. Per layer (``batched=False``, blob format 2:
    ``gpu.decode_on``), the layers decode on the codec's worker threads."""
    kv = random_kv(uniform_layout(layers=3), 64, seed=3)
    with entropy.writing_format(2):  # the format ``gpu.decode_on`` takes; any for the rest
        blob = codec.encode(kv, mode, level)
    want = codec.decode(blob)
    torch.cuda.set_device(0)
    got = [codec.decode(blob, device="cuda:1", batched=batched)]
    worker = threading.Thread(target=lambda: got.append(
        codec.decode(blob, device="cuda:1", batched=batched)))
    worker.start()
    worker.join()
    assert len(got) == 2  # the thread's decode raised nothing
    for kv_dev in got:
        assert all(k.device == torch.device("cuda", 1) for k, _ in kv_dev.layers)
        if batched is None:  # the whole-entry decoders: bit-identical to the CPU's
            assert kv_dev.to("cpu").equal(want)
        for (kc, vc), (kg, vg) in zip(want.layers, kv_dev.layers, strict=True):
            torch.testing.assert_close(kg.cpu(), kc)
            torch.testing.assert_close(vg.cpu(), vc)
