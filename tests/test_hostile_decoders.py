"""Hostile bytes behind resealed checksums, one decoder stage at a time: what a decoder spends
before it refuses a blob stays in proportion to the bytes stored (the whole-container cases
and the fuzz targets are in test_hostile.py)."""

from __future__ import annotations

import struct
import tracemalloc
from collections.abc import Callable

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.codec import api, rans
from kdn.codec.entropy import RANS_NIBBLE_MARK, decode_streams, encode_streams, parse_tables
from kdn.codec.format import (
    FRAME_SEED,
    build_frame,
    build_record,
    check_frame,
    parse_container,
    seal,
)
from kdn.errors import Corrupt, InvalidArgument
from kdn.layout import DType, KVLayout, LayerLayout


def _header_end(blob: bytes) -> int:
    """Where a format-4 blob's rANS section starts (after its tables and codes)."""
    mark, tlen, clen = struct.unpack_from("<III", blob)
    assert mark == RANS_NIBBLE_MARK
    return 12 + tlen + clen


def _one_stream_per_symbol(n: int) -> bytes:
    """A blob of one row that is 0 but once (the cheapest a row wider than one codes), its rANS
    section declaring blocks of one symbol over ``n`` tokens: as many streams as symbols, with
    the group count that agrees, but payload bytes for the information bound only, not the 4
    state bytes each stream needs."""
    sym = np.zeros((1, 4096), np.int32)
    sym[0, 7] = 1
    head = encode_streams(sym)[: _header_end(encode_streams(sym))]
    groups = -(-n // rans.GROUP)
    return head + struct.pack("<II", 1, groups) + bytes(n // 64)


def _cpu() -> Callable[[bytes, int], object]:
    return lambda blob, n: decode_streams(blob, 1, n)


def _gpu_on_cpu() -> Callable[[bytes, int], object]:
    gpu = pytest.importorskip("kdn.codec.gpu")  # Triton: the checks run before any kernel
    return lambda blob, n: gpu.decode_on(blob, 1, n, torch.device("cpu"))


@pytest.mark.parametrize("decoder", [_cpu, _gpu_on_cpu], ids=["cpu", "gpu"])
def test_a_section_of_more_streams_than_its_bytes_hold_is_refused_unplanned(
        decoder: Callable[[], Callable[[bytes, int], object]]) -> None:
    """Blocks of one symbol over a header's 4M tokens declare 4M streams; the 64 KB blob holds
    none of their states. Refused from the counts, before the decoder's plan of 16 bytes a
    stream (64 MB here; a 12 KB blob declaring 33M tokens took 6.8 s and 770 MB to refuse)."""
    decode = decoder()
    n = 1 << 22
    blob = _one_stream_per_symbol(n)
    assert len(blob) < 70_000
    tracemalloc.start()
    try:
        with pytest.raises(Corrupt, match="sizes do not add up"):
            decode(blob, n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 * len(blob), f"{peak} bytes traced refusing a {len(blob)}-byte blob"


def test_a_section_of_one_symbol_blocks_that_holds_its_streams_decodes() -> None:
    """The counted check takes what ``rans.encode`` writes with any block, down to 1."""
    rng = np.random.default_rng(3)
    sym = np.clip(np.round(rng.normal(0, 2, (3, 50))), -9, 9).astype(np.int32)
    sym[1] = 4  # a constant row: no streams
    blob = encode_streams(sym)
    head = blob[: _header_end(blob)]
    lo, width, counts, _ = parse_tables(blob, 3, 50)
    for block in (1, 7, 50, 1 << 20):
        section = rans.encode(sym, lo, width, counts, block=block)
        assert rans.check_section(memoryview(section), width, 50)[0] == block
        assert (decode_streams(head + section, 3, 50) == sym).all(), block


def _declaring_tokens(blob: bytes, tokens: int) -> bytes:
    """``blob`` (one layer a frame) with its header and every record declaring ``tokens``,
    its bodies as they are, every checksum recomputed."""
    container = parse_container(blob)
    header = container.header
    frames = []
    for i, frame in enumerate(container.frames):
        rec = check_frame(header, i, frame)[0]
        frames.append(build_frame(FRAME_SEED, i, rec.layer, [
            build_record(header.layout.layers[rec.layer], tokens, bytes(rec.body))]))
    entry = header.entry
    entry.tokens = tokens
    h, sealed = seal(entry, frames)
    return b"".join([h, *sealed])


def test_cachegen_refuses_scales_short_of_the_declared_tokens_before_its_symbols() -> None:
    """A 1-token cachegen entry codes every symbol row as a constant (no payload): resealed to
    declare 1M tokens, its 2-byte scale sections can not be those tokens' (2 bytes a token).
    Refused from their lengths, before [rows, tokens] symbols are made (128 MB here; a fuzzed
    entry of 9 such layers took 4 s and 512 MB to refuse at 33M tokens)."""
    layout = KVLayout("hostile-cachegen", (LayerLayout(2, 8, 8),), dtype=DType.FLOAT32,
                      head_dim=8)
    kv = KVCache(layout, [(torch.randn(2, 1, 8), torch.randn(2, 1, 8))])
    blob = _declaring_tokens(codec.encode(kv, "cachegen", layers_per_frame=1), 1 << 20)
    assert len(blob) < 1000
    _warm("cachegen", "")
    tracemalloc.start()
    try:
        with pytest.raises(Corrupt, match="scale section has 2 bytes for 1048576 tokens"):
            codec.decode(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes traced refusing a {len(blob)}-byte entry"


def _warm(mode: str, level: str) -> None:
    """One small entry of ``mode`` decoded: what its first decode in a process allocates once
    (imports, caches; over 1 MB) is not counted against the entry a test traces next."""
    small = KVLayout("small", (LayerLayout(1, 4, 4),), head_dim=4)
    one = torch.ones(1, 1, 4, dtype=torch.float16)
    codec.decode(codec.encode(KVCache(small, [(one, one)]), mode, level))


@pytest.mark.parametrize("mode", ["kdn", "cachegen"])
def test_an_entry_of_no_tokens_decodes_without_tables_for_its_streams(mode: str) -> None:
    """A 0-token layer of 4096 heads x 4096 + 4096 channels is 33.5M entropy streams of no
    symbol: its tables were made as arrays (400 MB for a ~300-byte entry; a layer of 65535
    heads x 65535 + 65535 channels, which a header may declare, raised MemoryError)."""
    layout = KVLayout("hostile-wide", (LayerLayout(4096, 4096, 4096),), head_dim=4096)
    empty = torch.zeros(4096, 0, 4096, dtype=torch.float16)
    kv = KVCache(layout, [(empty, empty)])
    level = "default" if mode == "kdn" else ""
    with pytest.raises(InvalidArgument, match="holds no tokens"):  # no client stores one...
        codec.encode(kv, mode, level)
    blob = api._encode_unchecked(kv, mode, level, 1, False).to_bytes()  # noqa: SLF001
    assert len(blob) < 1000  # ...but a hostile peer may send one
    _warm(mode, level)
    tracemalloc.start()
    try:
        out = codec.decode(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [tuple(t.shape) for t in out.layers[0]] == [(4096, 0, 4096)] * 2
    assert peak < 1 << 20, f"{peak} bytes traced decoding a {len(blob)}-byte entry"


@pytest.mark.parametrize("fmt", [2, 4])
def test_constant_rows_cost_no_lookup_tables(fmt: int) -> None:
    """Rows of one value (no stream) cost no payload, and little table: 100k of them beside
    one coded row over 2 tokens is a blob of ~100 bytes in format 2 (50 KB in format 4, half
    a byte a row). The rANS decoder's bucket table was 3 KB a row (300 MB here; 1M rows took
    55 s and 3.1 GB to decode into 8 MB of symbols); it holds coded rows only."""
    rows, n = 100_000, 2
    sym = np.zeros((rows, n), np.int32)
    sym[rows // 2, 1] = 1  # the one coded row
    sym[rows - 1] = -3  # another constant
    blob = encode_streams(sym, fmt=fmt)
    decode_streams(encode_streams(sym[rows // 2 - 1 : rows // 2 + 1], fmt=fmt), 2, n)  # jitted
    tracemalloc.start()
    try:
        out = decode_streams(blob, rows, n)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert (out == sym).all()
    assert peak < 128 * rows, f"{peak} bytes traced decoding {rows} rows of {n} symbols"


def test_tables_of_more_streams_than_the_host_holds_are_refused_before_reading_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decoder holds ~66 bytes of tables and models a stream (row), whatever its tokens: 4M
    constant rows of one token (a 2 MB blob, 8 MB of symbols) took 5 s and 264 MB. Rows past
    what the host could hold are TooLarge before any table is read (a layer of 2e9 rows of one
    token is within the 4 GiB layer limit, and would need ~130 GB)."""
    import zstandard

    from kdn.codec import room
    from kdn.codec.entropy import TABLE_BYTES_PER_STREAM, pack_nibbles
    from kdn.errors import TooLarge

    rows = 4_000_000
    bounds = np.zeros(rows, "<i2").tobytes() + np.ones(rows, "<u2").tobytes()
    packed = zstandard.ZstdCompressor().compress(bounds)
    codes = pack_nibbles(np.full(rows, 15, np.uint8))
    blob = (struct.pack("<III", RANS_NIBBLE_MARK, len(packed), len(codes)) + packed + codes
            + struct.pack("<II", 1024, 0))
    assert rows * TABLE_BYTES_PER_STREAM > room.ROOM_CHECKED_BYTES
    monkeypatch.setattr(room, "host_room", lambda: 200 << 20)
    tracemalloc.start()
    try:
        with pytest.raises(TooLarge, match=r"needs entropy tables of 0\.3 GiB \(1 tokens\)"):
            decode_streams(blob, rows, 1)
        assert tracemalloc.get_traced_memory()[1] < 1 << 20
    finally:
        tracemalloc.stop()
    small = encode_streams(np.zeros((3, 5), np.int32))
    assert (decode_streams(small, 3, 5) == 0).all()  # few rows: the host is not asked
