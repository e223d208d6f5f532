"""A whole entry decoded on the GPU from bytes nobody checked (``kdn.codec.decode`` on CUDA,
``batched=True`` here) has its frames' sums computed on a worker thread while the planner,
copies and kernels run (``format.sums_checked_later``), and waited for in ``Decoded.check``:
damage is refused with the error the CPU path gives, and no tensor comes back unchecked.
The kernels are not launched (``gpu_batch._launch`` stubbed): what is checked is the host's
order of checks, which the interpreter tests of test_gpu_batch do not need for this."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from kdn import codec
from kdn.codec import format as fmt
from kdn.codec import gpu_batch
from kdn.codec.api import entry_bodies
from kdn.codec.format import parse_container
from kdn.errors import Corrupt, KDNError
from tests.helpers import random_kv, uniform_layout


@pytest.fixture
def no_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Kernels not launched; the names of the threads that computed frame sums."""
    monkeypatch.setattr(gpu_batch, "_launch", lambda *a, **k: None)
    threads: list[str] = []
    real = fmt.frame_sum

    def frame_sum(*args: Any) -> int:
        t = threading.current_thread()
        if t is threading.main_thread() or t.name.startswith("kdn-sums"):  # not a leftover
            threads.append(t.name)  # thread of another test's server
        return real(*args)

    monkeypatch.setattr(fmt, "frame_sum", frame_sum)
    return threads


def _blob(mode: str = "kdn", level: str = "default") -> bytearray:
    return bytearray(codec.encode(random_kv(uniform_layout(4, 2, 8), 40, seed=1), mode, level,
                                  layers_per_frame=2))


def _frame_at(blob: bytearray, index: int) -> int:
    """Where frame ``index`` starts in ``blob``."""
    whole = bytes(blob)
    frame = parse_container(whole, verify=False).frames[index]
    return int(np.frombuffer(frame, np.uint8).ctypes.data
               - np.frombuffer(whole, np.uint8).ctypes.data)


def _error(blob: bytes, **kw: Any) -> str:
    with pytest.raises(KDNError) as info:
        codec.decode(blob, **kw)
    return f"{type(info.value).__name__}: {info.value}"


@pytest.mark.parametrize("mode,level", [("kdn", "default"), ("int8", "")])
def test_sums_are_computed_beside_the_decode_and_checked_before_it_returns(
        no_kernels: list[str], mode: str, level: str) -> None:
    blob = bytes(_blob(mode, level))
    codec.decode(blob, batched=True)
    frames = len(parse_container(blob, verify=False).frames)
    assert len(no_kernels) == frames and all(t.startswith("kdn-sums") for t in no_kernels), \
        no_kernels
    no_kernels.clear()
    codec.decode(blob)  # the CPU path checks each frame first, on the caller's thread
    assert len(no_kernels) == frames and not any(t.startswith("kdn-sums") for t in no_kernels)


@pytest.mark.parametrize("where", ["payload", "record header", "last byte"])
def test_damage_is_refused_as_the_cpu_path_refuses_it(no_kernels: list[str], where: str) -> None:
    blob = _blob()
    at = _frame_at(blob, 1) + fmt.FRAME_STRUCT.size
    if where == "payload":
        at += fmt._RECORD.size + 9  # noqa: SLF001  (a body byte of the frame's first layer)
    elif where == "record header":
        at += 4  # the first record's token count: the walk would refuse it as a bad shape
    else:
        at = len(blob) - 1
    blob[at] ^= 0x21
    cpu = _error(bytes(blob))
    assert cpu.startswith("Corrupt") and "checksum mismatch" in cpu, cpu
    assert _error(bytes(blob), batched=True) == cpu


def test_a_failed_sum_leaves_no_tensors_and_fails_every_check(no_kernels: list[str]) -> None:
    blob = _blob()
    blob[_frame_at(blob, 1) - 1] ^= 1  # a word of frame 0's last rANS stream: planned, not
    # refused, by the host (the kernels, not run here, are what would see it)
    c = parse_container(bytes(blob), verify=False)
    got = entry_bodies(c.header, c.frames)
    done = codec.StreamDecoder(c.header, "cpu").decode_beside_sums(got, c.frames)
    for _ in range(2):
        with pytest.raises(Corrupt, match="frame 0: checksum mismatch"):
            done.check()
    assert done.layers == [] and done.flag is None and done.keep == []
