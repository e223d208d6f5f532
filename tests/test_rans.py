"""The parallel-decodable entropy format (kdn.codec.rans through kdn.codec.entropy): exact round
trips of awkward shapes, sizes next to the range coder it replaced, old blobs still decoded,
and damaged or hostile sections refused with Corrupt (never a crash, a hang or wrong symbols
passed off as right)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import zstandard

from kdn.codec.entropy import (
    LOG_LEVELS,
    RANS_LOG_MARK,
    RANS_MARK,
    RANS_NIBBLE_MARK,
    _range_coded,
    _tables,
    decode_streams,
    encode_streams,
    writing_format,
)
from kdn.errors import Corrupt


def _sym(rows: int, n: int, seed: int = 0, spread: float = 1.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.normal(0, spread, (rows, n))), -40, 40).astype(np.int32)


def _format1(sym: np.ndarray) -> bytes:
    """A blob as the range coder wrote it before the parallel format."""
    lo, width, counts = _tables(sym)
    tables = lo.astype("<i2").tobytes() + width.astype("<u2").tobytes() + counts.tobytes()
    packed = zstandard.ZstdCompressor(level=9).compress(tables)
    return struct.pack("<I", len(packed)) + packed + _range_coded(sym, lo, width, counts)


@pytest.mark.parametrize("rows,n", [(1, 1), (1, 2), (3, 5), (40, 1023), (40, 1024), (40, 1025),
                                    (33, 2500), (200, 64)])
def test_round_trip_of_awkward_shapes(rows: int, n: int) -> None:
    sym = _sym(rows, n, seed=rows * n)
    sym[0] = 7  # a constant row: no stream at all
    if rows > 2:
        sym[2, :] = np.arange(n) % 3000 - 1500  # a wide row
    for fmt, mark in ((4, RANS_NIBBLE_MARK), (3, RANS_LOG_MARK), (2, RANS_MARK)):
        blob = encode_streams(sym) if fmt == 4 else encode_streams(sym, fmt=fmt)
        assert struct.unpack_from("<I", blob)[0] == mark  # 3 and 2: what earlier kdn wrote
        assert (decode_streams(blob, rows, n) == sym).all()


def _rans_section(blob: bytes) -> int:
    """Where a format-4 blob's rANS section starts."""
    tlen, clen = struct.unpack_from("<II", blob, 4)
    return 12 + tlen + clen


def _table_bytes(blob: bytes) -> bytes:
    """A format-3 blob's tables (lo, width, a byte per count code)."""
    tlen = struct.unpack_from("<I", blob, 4)[0]
    return zstandard.ZstdDecompressor().decompress(blob[8 : 8 + tlen])


def test_log_coded_counts_shrink_blobs_of_short_rows() -> None:
    """Rows of 256 symbols (a 256-token block's): the tables are a large share of the blob, and
    4-bit codes of the counts cost less than they lose in payload."""
    for seed, spread in ((1, 0.8), (2, 1.5), (3, 4.0)):
        sym = _sym(512, 256, seed, spread)
        coded, exact = encode_streams(sym, fmt=3), encode_streams(sym, fmt=2)
        assert len(coded) < 0.97 * len(exact), (spread, len(coded), len(exact))
        rows = 512
        codes = np.frombuffer(_table_bytes(coded), np.uint8, offset=4 * rows)
        assert codes.max() < len(LOG_LEVELS) and codes.min() >= 0
        nibbles = encode_streams(sym)  # format 4: the same codes, outside zstd
        assert len(nibbles) < min(1.02 * len(coded), 0.98 * len(exact)), \
            (spread, len(nibbles), len(coded), len(exact))
        tlen = struct.unpack_from("<I", nibbles, 4)[0]
        lo_width = zstandard.ZstdDecompressor().decompress(nibbles[12 : 12 + tlen])
        assert len(lo_width) == 4 * rows  # all the host decompresses
        packed = np.frombuffer(nibbles, np.uint8, offset=12 + tlen, count=(len(codes) + 1) // 2)
        assert (np.stack([packed & 15, packed >> 4], 1).ravel()[: len(codes)] == codes).all()


@pytest.mark.parametrize("damage", ["codes cut short", "a code too many", "spare half set",
                                    "codes past the blob"])
def test_format_4_codes_that_do_not_fit_the_widths_are_refused(damage: str) -> None:
    rng = np.random.default_rng(12)
    sym = rng.integers(-1, 2, (15, 300)).astype(np.int32)  # 15 rows of 3 bins: 45 in all
    blob = bytearray(encode_streams(sym))
    tlen, clen = struct.unpack_from("<II", blob, 4)
    lo_width = zstandard.ZstdDecompressor().decompress(bytes(blob[12 : 12 + tlen]))
    bins = int(np.frombuffer(lo_width, "<u2", count=15, offset=30).sum())
    assert bins % 2 == 1 and clen == (bins + 1) // 2
    last = 12 + tlen + clen - 1
    if damage == "codes cut short":
        bad = blob[:4] + struct.pack("<II", tlen, clen - 1) + blob[12:last] + blob[last + 1 :]
    elif damage == "a code too many":
        bad = blob[:4] + struct.pack("<II", tlen, clen + 1) + blob[12 : last + 1] + b"\x01" + \
            blob[last + 1 :]
    elif damage == "spare half set":
        bad = bytearray(blob)
        bad[last] |= 0x10
    else:
        bad = blob[:8] + struct.pack("<I", len(blob)) + blob[12:]
    with pytest.raises(Corrupt, match="codes are|do not add up"):
        decode_streams(bytes(bad), 15, 300)


def test_a_count_code_out_of_range_is_refused() -> None:
    sym = _sym(16, 300, seed=9)
    blob = encode_streams(sym, fmt=3)
    tables = bytearray(_table_bytes(blob))
    tables[4 * 16 + 1] = len(LOG_LEVELS)  # the first row's second bin: no such code
    packed = zstandard.ZstdCompressor().compress(bytes(tables))
    tlen = struct.unpack_from("<I", blob, 4)[0]
    bad = blob[:4] + struct.pack("<I", len(packed)) + packed + blob[8 + tlen :]
    with pytest.raises(Corrupt, match="code out of range"):
        decode_streams(bad, 16, 300)


def test_sizes_stay_within_two_percent_of_the_range_coder() -> None:
    for seed, spread in ((1, 0.6), (2, 1.3), (3, 4.0)):
        sym = _sym(192, 2048, seed, spread)
        new, old = len(encode_streams(sym)), len(_format1(sym))
        assert new <= 1.02 * old, (spread, new, old)


def test_blobs_of_the_range_coder_still_decode() -> None:
    sym = _sym(24, 700, seed=4)
    assert (decode_streams(_format1(sym), 24, 700) == sym).all()


def test_layers_decode_side_by_side_on_threads() -> None:
    from concurrent.futures import ThreadPoolExecutor

    mats = [_sym(100, 1800, seed=s) for s in range(6)]
    blobs = [encode_streams(m) for m in mats]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda b: decode_streams(b, 100, 1800), blobs))
    assert all((o == m).all() for o, m in zip(outs, mats))


def test_damaged_sections_are_refused() -> None:
    sym = _sym(40, 1500, seed=6)
    blob = bytearray(encode_streams(sym))
    section = _rans_section(bytes(blob))  # where rANS's own bytes start
    block, groups = struct.unpack_from("<II", blob, section)
    cases = {
        "truncated": bytes(blob[:-3]),
        "no words": bytes(blob[: len(blob) - 2 * 200]),
        "extra word": bytes(blob) + b"\0\0",
        "groups": (bytes(blob[: section + 4]) + struct.pack("<I", groups + 1)
                   + bytes(blob[section + 8 :])),
        "block 0": bytes(blob[:section]) + struct.pack("<I", 0) + bytes(blob[section + 4:]),
    }
    for name, bad in cases.items():
        with pytest.raises(Corrupt):
            decode_streams(bad, 40, 1500)
        assert name
    rng = np.random.default_rng(7)
    states_at = section + 8
    wrong = 0
    for _ in range(200):  # flipped bits in states and words: refused, or (rarely) other symbols
        bad = bytearray(blob)
        pos = int(rng.integers(states_at, len(bad)))
        bad[pos] ^= 1 << int(rng.integers(0, 8))
        try:
            out = decode_streams(bytes(bad), 40, 1500)
        except Corrupt:
            continue
        wrong += int(not (out == sym).all())
    assert wrong <= 2  # the container's frame checksums are what catches these; the coder's
    # own end-state and word-count checks refuse nearly all of them on their own


def test_hostile_words_and_states_end_in_corrupt_not_a_crash() -> None:
    sym = _sym(8, 3000, seed=8)
    blob = bytearray(encode_streams(sym))
    rng = np.random.default_rng(9)
    body_at = _rans_section(bytes(blob)) + 8
    for _ in range(50):
        bad = bytearray(blob)
        bad[body_at:] = rng.integers(0, 256, len(bad) - body_at, dtype=np.uint8).tobytes()
        with pytest.raises(Corrupt):
            decode_streams(bytes(bad), 8, 3000)


def test_writing_format_sets_what_every_encode_writes_and_puts_it_back() -> None:
    sym = _sym(6, 200, seed=13)
    with pytest.raises(ValueError, match="not 5"):
        with writing_format(5):
            pass
    with writing_format(3):
        assert struct.unpack_from("<I", encode_streams(sym))[0] == RANS_LOG_MARK
        assert struct.unpack_from("<I", encode_streams(sym, fmt=2))[0] == RANS_MARK
    with pytest.raises(RuntimeError), writing_format(2):
        raise RuntimeError("an encode that failed")
    assert struct.unpack_from("<I", encode_streams(sym))[0] == RANS_NIBBLE_MARK
    with pytest.raises(ValueError, match="not 1"):
        encode_streams(sym, fmt=1)


def _most_compressible(rows: int, n: int, seed: int) -> np.ndarray:
    """Rows whose likeliest bin holds all but one or two symbols (a single outlier at one end):
    the fewest payload bits per symbol any row wider than one can cost."""
    rng = np.random.default_rng(seed)
    sym = np.zeros((rows, n), np.int32)
    for r in range(rows):
        sym[r, int(rng.integers(0, n))] = 1 + r % 3
        if r % 2:
            sym[r, int(rng.integers(0, n))] = -1
    return sym


@pytest.mark.parametrize("fmt", [1, 2, 3, 4])
def test_the_most_compressible_rows_still_decode(fmt: int) -> None:
    """The payload bound of ``parse_tables`` refuses no blob an encoder writes, down to rows of
    one outlier in 400k symbols (each symbol then costs ~0.006 bits)."""
    for rows, n in ((1, 400_000), (6, 100_003), (64, 2_000)):
        sym = _most_compressible(rows, n, seed=rows)
        blob = _format1(sym) if fmt == 1 else encode_streams(sym, fmt=fmt)
        assert (decode_streams(blob, rows, n) == sym).all(), (fmt, rows, n, len(blob))


def _declaring(blob: bytes, rows: int, n: int, fmt: int) -> bytes:
    """``blob``'s tables over a payload shaped for ``n`` symbols a row but carrying none: for
    rANS the fewest, longest streams (blocks of 2**20) with zero states and no words."""
    if fmt == 1:
        tlen = struct.unpack_from("<I", blob)[0]
        return blob[: 4 + tlen] + bytes(8)
    streams = rows * -(-n // (1 << 20))
    groups = -(-streams // 32)
    return (blob[: _rans_section(blob)] + struct.pack("<II", 1 << 20, groups)
            + bytes(4 * streams + 4 * groups))


@pytest.mark.parametrize("fmt", [1, 4])
def test_a_payload_too_short_for_the_symbols_it_declares_is_refused_before_decoding(
        fmt: int) -> None:
    """A header may declare millions of tokens over a payload of a few bytes: refused from the
    tables' own information bound, before a decoder runs over every declared symbol (the
    range coder took 12 s and 3 GB to refuse a fuzzed layer of 33M tokens)."""
    import time

    sym = np.tile(np.array([[0, 1, 1, 2]], np.int32), (2, 64))
    blob = _format1(sym) if fmt == 1 else encode_streams(sym)
    n = 1 << 22
    started = time.perf_counter()
    with pytest.raises(Corrupt, match="too short for 4194304 symbols"):
        decode_streams(_declaring(blob, 2, n, fmt), 2, n)
    assert time.perf_counter() - started < 0.5


def test_a_table_row_whose_end_bins_count_nothing_is_refused() -> None:
    """An encoder's row spans its smallest to its largest symbol, so both end bins count: a
    row whose end bin counts nothing could put every symbol in one bin at no cost."""
    sym = _sym(4, 300, seed=14)
    blob = encode_streams(sym, fmt=2)
    tlen = struct.unpack_from("<I", blob, 4)[0]
    tables = bytearray(zstandard.ZstdDecompressor().decompress(blob[8 : 8 + tlen]))
    width0 = struct.unpack_from("<H", tables, 8)[0]
    tables[16 + width0 - 1] = 0  # the first row's last bin
    packed = zstandard.ZstdCompressor().compress(bytes(tables))
    bad = blob[:4] + struct.pack("<I", len(packed)) + packed + blob[8 + tlen :]
    with pytest.raises(Corrupt, match="end symbols"):
        decode_streams(bad, 4, 300)


def test_kernels_compile_where_numba_has_nowhere_to_cache_them(tmp_path: Path) -> None:
    """numba's cache=True raised RuntimeError 'cannot cache function ...: no locator available'
    at import where no cache directory is writable (kdn installed read-only, HOME=/nonexistent):
    every entropy decode died. Here no locator applies (numba's only one asked, the
    NUMBA_CACHE_DIR one, has no directory): the modules import, their kernels compile
    uncached."""
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator",
               PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    code = ("import numpy as np\n"
            "import kdn.codec.entropy, kdn.codec.gpu_plan\n"
            "from kdn.codec.rans import M, normalize\n"
            "freq, cum = normalize(np.array([2, 1]), np.array([3, 1, 5]))\n"
            "assert freq.sum() == 2 * M\n"
            "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
