"""Checked copies of codec containers (whole, in pieces, on several workers) and tensors that
borrow their bytes instead of copying them.
"""

from __future__ import annotations

import pytest
import torch

from kdn.cache import KVCache
from kdn.codec import StreamDecoder, decode, encode, encode_parts
from kdn.codec.copies import copy_checked
from kdn.codec.modes import tensor_borrowed
from kdn.errors import Corrupt, InvalidArgument, KDNError
from tests.helpers import pruned_layout, random_kv, small_kv, uniform_layout


@pytest.mark.parametrize("layers_per_frame", [1, 2])
def test_copy_checked_copies_and_finds_every_damage(layers_per_frame: int) -> None:
    blob = bytearray(encode(small_kv(), "raw", layers_per_frame=layers_per_frame))
    out = bytearray(len(blob))
    copy_checked(memoryview(out), bytes(blob))
    assert out == blob
    for i in range(len(blob)):  # a flipped byte anywhere: header, frame prefix, record, body
        blob[i] ^= 0x40
        with pytest.raises(KDNError):
            copy_checked(memoryview(bytearray(len(blob))), bytes(blob))
        blob[i] ^= 0x40
    for n in (10, len(blob) - 1):
        with pytest.raises(KDNError):
            copy_checked(memoryview(bytearray(n)), bytes(blob[:n]))
    with pytest.raises(KDNError):  # bytes after the last frame
        copy_checked(memoryview(bytearray(len(blob) + 3)), bytes(blob) + b"abc")
    with pytest.raises(InvalidArgument):
        copy_checked(memoryview(bytearray(5)), bytes(blob))


def test_copy_checked_hashes_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    import kdn.codec.copies as copies

    monkeypatch.setattr(copies, "COPY_CHUNK", 7)  # many chunks per frame, one frame per layer
    kv = random_kv(uniform_layout(), 9, seed=2)
    blob = encode(kv, "raw")
    out = bytearray(len(blob))
    copies.copy_checked(memoryview(out), blob)
    assert decode(bytes(out)).equal(kv)
    bad = bytearray(blob)
    bad[-1] ^= 1
    with pytest.raises(Corrupt):
        copies.copy_checked(memoryview(bytearray(len(bad))), bytes(bad))


@pytest.mark.parametrize("chunk", [7, 1 << 20])
def test_a_frame_copied_from_pieces_is_checked_as_the_whole_frame(
        monkeypatch: pytest.MonkeyPatch, chunk: int) -> None:
    """``copy_pieces_checked``: any cut of a frame into pieces (some shorter than its prefix)
    copies it whole and passes; a byte flipped anywhere in any piece, or pieces not adding up
    to the destination, is refused."""
    import random

    import kdn.codec.copies as copies
    import kdn.codec.format as fmt

    monkeypatch.setattr(copies, "COPY_CHUNK", chunk)
    blob = encode(random_kv(uniform_layout(), 9, seed=3), "raw", layers_per_frame=2)
    container = fmt.parse_container(blob)
    rng = random.Random(5)
    for index, frame in enumerate(container.frames):
        data = bytes(frame)
        for _ in range(4):
            cuts = sorted(rng.sample(range(1, len(data)), rng.randrange(1, 6)))
            pieces = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)])]
            out = bytearray(len(data))
            copies.copy_pieces_checked(container.header, index, memoryview(out), pieces)
            assert out == data
        for at in range(0, len(data), max(1, len(data) // 97)):
            bad = bytearray(data)
            bad[at] ^= 0x10
            pieces = [bytes(bad[:at // 2 + 1]), bytes(bad[at // 2 + 1:])]
            with pytest.raises(KDNError):
                copies.copy_pieces_checked(container.header, index,
                                        memoryview(bytearray(len(data))), pieces)
        with pytest.raises(InvalidArgument):
            copies.copy_pieces_checked(container.header, index, memoryview(bytearray(len(data))),
                                    [data[:10], data[11:]])
        with pytest.raises(KDNError):  # a frame in another frame's place
            copies.copy_pieces_checked(container.header, index + 1 if index == 0 else 0,
                                    memoryview(bytearray(len(data))), [data])


@pytest.mark.parametrize("workers", [2, 3])
def test_copy_checked_on_several_workers_copies_whole_frames_and_waits_for_all(
        monkeypatch: pytest.MonkeyPatch, workers: int) -> None:
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import kdn.codec.copies as copies

    monkeypatch.setattr(copies, "PARALLEL_COPY_BYTES", 1)  # every entry is large enough
    kv = random_kv(pruned_layout(), 40, seed=4)
    blob = encode(kv, "raw", layers_per_frame=1)
    checked: list[tuple[str, int]] = []
    real = copies.check_frame_prefix

    def spy(header, index, *a, **k):  # type: ignore[no-untyped-def]
        checked.append((threading.current_thread().name, index))
        return real(header, index, *a, **k)

    monkeypatch.setattr(copies, "check_frame_prefix", spy)
    class Counting(ThreadPoolExecutor):
        runs = 0

        def submit(self, *a, **k):  # type: ignore[no-untyped-def]
            Counting.runs += 1
            return super().submit(*a, **k)

    with Counting(workers, thread_name_prefix="copy") as pool:
        out = bytearray(len(blob))
        copies.copy_checked(memoryview(out), blob, pool=pool, workers=workers)
        assert bytes(out) == blob and Counting.runs == workers - 1  # the last run: here
        assert sorted(i for _, i in checked) == list(range(kv.layout.num_layers))
        names = {name for name, _ in checked}
        assert threading.current_thread().name in names and any(
            n.startswith("copy") for n in names)  # on the pool's threads and this one
        bad = bytearray(blob)
        bad[len(bad) // 3] ^= 0x10  # in the first run: the later runs still end first
        dst = bytearray(len(bad))
        with pytest.raises(Corrupt):
            copies.copy_checked(memoryview(dst), bytes(bad), pool=pool, workers=workers)
        assert dst[-100:] == bad[-100:]  # the last run copied before the error came out
        bad = bytearray(blob)
        bad[-1] ^= 0x10  # in the last run
        with pytest.raises(Corrupt):
            copies.copy_checked(memoryview(bytearray(len(bad))), bytes(bad), pool=pool,
                             workers=workers)


def test_borrowed_tensors_view_writable_aligned_bytes_only() -> None:
    buf = bytearray(66)
    view = tensor_borrowed(memoryview(buf)[2:66], torch.float16, (2, 16))
    assert view is not None
    view.fill_(1.0)
    assert buf[2:4] == torch.tensor([1.0], dtype=torch.float16).view(torch.int16).numpy().tobytes()
    assert tensor_borrowed(memoryview(buf)[1:65], torch.float16, (2, 16)) is None  # misaligned
    assert tensor_borrowed(memoryview(bytes(64)), torch.float16, (2, 16)) is None  # read-only
    assert tensor_borrowed(memoryview(buf)[2:64], torch.float16, (2, 16)) is None  # wrong size


def test_a_decoder_that_borrows_decodes_the_same_and_still_checks() -> None:
    kv = random_kv(uniform_layout(), 12, seed=4)
    parts = encode_parts(kv, "raw")
    frames = [bytearray(f) for f in parts.frames]
    dec = StreamDecoder(parts.header, borrow=True)
    layers = [x for i, f in enumerate(frames) for x in dec.decode_frame(i, memoryview(f))]
    assert KVCache(kv.layout, [(k, v) for _, k, v in layers]).equal(kv)
    frames[0][-1] ^= 1
    with pytest.raises(Corrupt):
        dec.decode_frame(0, memoryview(frames[0]))
    trusting = StreamDecoder(parts.header, borrow=True, checked=True)  # sums skipped, not shapes
    trusting.decode_frame(0, memoryview(frames[0]))
    with pytest.raises(KDNError):
        trusting.decode_frame(0, memoryview(frames[0])[:-1])


def test_a_decoder_that_does_not_borrow_copies() -> None:
    kv = random_kv(uniform_layout(), 12, seed=6)
    parts = encode_parts(kv, "raw")
    frames = [bytearray(f) for f in parts.frames]
    dec = StreamDecoder(parts.header)
    layers = {i: (k, v) for j, f in enumerate(frames) for i, k, v in dec.decode_frame(j, f)}
    for k, v in layers.values():
        k.zero_()
        v.zero_()
    assert [bytes(f) for f in frames] == parts.frames  # the caller's buffers are untouched
    assert decode(parts.to_bytes()).equal(kv)
