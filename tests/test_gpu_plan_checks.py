"""Entropy tables no encoder writes, refused by the CPU decoder and by the whole-entry GPU
decoder's planner alike (``kdn.codec.gpu_plan``), before anything is launched: the tables'
one zstd frame."""

from __future__ import annotations

import pytest

from tests.test_gpu_batch import _layers_with_symbols_blob, _refused_by_both


@pytest.mark.parametrize("fmt", [2, 4])
@pytest.mark.parametrize("extra", [bytes(4), b"\x50\x2a\x4d\x18" + bytes(4)],
                         ids=["zeros", "skippable frame"])
def test_bytes_after_the_tables_zstd_frame_are_refused_by_both_decoders(fmt: int,
                                                                         extra: bytes) -> None:
    """The tables are one zstd frame: bytes after it, inside the declared table length (zeros,
    or an empty skippable frame libzstd would read past), are refused by the CPU decoder and
    by the planner, whichever zstd it decompresses with, before anything is launched."""
    import struct

    def edit(sym: bytes) -> bytes:
        tlen = struct.unpack_from("<I", sym, 4)[0]
        head = 12 if fmt == 4 else 8
        out = bytearray(sym[: head + tlen] + extra + sym[head + tlen :])
        struct.pack_into("<I", out, 4, tlen + len(extra))
        return bytes(out)

    _refused_by_both(*_layers_with_symbols_blob(fmt, edit), "unused data",
                     "entropy tables have bytes after their zstd frame")
