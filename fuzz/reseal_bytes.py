"""The byte layout of a container's frames as the fuzz targets edit it, and the fuzzed-input
helpers: frame prefix and record structs, records and sections of a body, zstd payloads, ints
and text drawn from a ``FuzzedDataProvider``, and the payload mutations that need no case
(``mutate_zstd``, ``mutate_entropy``: a blob in, a mutated blob out).

Import this module after the target has imported kdn under ``atheris.instrument_imports``.
"""

from __future__ import annotations

import struct

import atheris
import zstandard

from kdn.codec import entropy

FDP = atheris.FuzzedDataProvider
FRAME = struct.Struct("<2sHHHIL")  # magic, index, first layer, layer count, length, sum
RECORD = struct.Struct("<HIHHI")  # kv_heads, tokens, k_channels, v_channels, body length
RECORD_BITS = (16, 32, 16, 16, 32)
U32 = struct.Struct("<I")
ENTROPY_SECTIONS = {"kdn": (2, 3), "cachegen": (2,)}
SECTION_COUNT = {"int8": 4, "kdn": 4, "cachegen": 3}


def records(frame: bytes | bytearray) -> list[tuple[int, bytes]]:
    """(offset in the frame, body) of each whole record, as far as the bytes parse."""
    out = []
    off = FRAME.size
    while off + RECORD.size <= len(frame):
        blen = RECORD.unpack_from(frame, off)[4]
        at = off + RECORD.size
        if at + blen > len(frame):
            break
        out.append((off, bytes(frame[at : at + blen])))
        off = at + blen
    return out


def split_sections(body: bytes, count: int) -> list[bytes] | None:
    if len(body) < 4 * count:
        return None
    lens = struct.unpack_from(f"<{count}I", body)
    if 4 * count + sum(lens) != len(body):
        return None
    out, off = [], 4 * count
    for n in lens:
        out.append(body[off : off + n])
        off += n
    return out


def pack_sections_with_len(secs: list[bytes]) -> bytes:
    """u32 body length, then the body of ``secs`` (the tail of a record)."""
    body = struct.pack(f"<{len(secs)}I", *map(len, secs)) + b"".join(secs)
    return U32.pack(len(body)) + body


def with_payload(frame: bytes | bytearray, payload: bytes) -> bytearray:
    head = bytearray(frame[: FRAME.size].ljust(FRAME.size, b"\0"))
    struct.pack_into("<I", head, 8, len(payload))
    return head + payload


def unzstd(blob: bytes) -> bytes | None:
    """``blob`` decompressed, None where it does not decode or is large (the harness must not
    trip over the bombs it makes: ``kdn.codec.zstd``)."""
    try:
        if zstandard.frame_content_size(blob) > 1 << 22:
            return None
        return zstandard.ZstdDecompressor().decompress(blob, max_output_size=1 << 22)
    except zstandard.ZstdError:
        return None


INTERESTING = [0, 1, 2, 3, 4, 5, 6, 7, 8, 15, 16, 17, 31, 32, 33, 127, 128, 255, 256, 1023,
               1024, 1025, 2032, 2047, 2048, 2049, 4000, 4001, 32767, 32768, 65535, 65536,
               1 << 20, 1 << 24, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**40, 2**63, 2**64 - 1]


def some_int(fdp: FDP, bits: int, cur: int = 0) -> int:
    how = fdp.ConsumeIntInRange(0, 3)
    if how == 0:
        v = fdp.PickValueInList(INTERESTING)
    elif how == 1:
        v = cur + fdp.ConsumeIntInRange(-4, 4)
    else:
        v = fdp.ConsumeUInt((bits + 7) // 8)
    return v % (1 << bits)


def some_text(fdp: FDP, choices: list[str]) -> str:
    if fdp.ConsumeIntInRange(0, 3):
        return str(fdp.PickValueInList(choices))
    return str(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12)))


def some_index(fdp: FDP, n: int) -> int:
    return fdp.ConsumeIntInRange(0, n - 1) if n else 0


def mutate_zstd(fdp: FDP, blob: bytes) -> bytes:
    """``blob`` (zstd) decompressed, mutated and compressed again (its frame is valid)."""
    got = unzstd(blob)
    if got is None:
        return blob
    raw = bytearray(got)
    how = fdp.ConsumeIntInRange(0, 3)
    pos = some_index(fdp, len(raw) + 1)
    if how == 0 and pos < len(raw):
        raw[pos] = fdp.ConsumeIntInRange(0, 255)
    elif how == 1:
        del raw[pos : pos + fdp.ConsumeIntInRange(1, 64)]
    elif how == 2:
        raw[pos:pos] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 64))
    else:
        width = fdp.PickValueInList([2, 4])
        raw[pos : pos + width] = some_int(fdp, 8 * width).to_bytes(width, "little")
    zc = zstandard.ZstdCompressor(level=1, write_content_size=fdp.ConsumeBool())
    return zc.compress(bytes(raw))

def mutate_entropy(fdp: FDP, blob: bytes) -> bytes:
    """A structural mutation of an entropy blob (``kdn.codec.entropy`` / ``rans``)."""
    b = bytearray(blob)
    if len(b) < 12:
        return bytes(b) + fdp.ConsumeBytes(12)
    mark = U32.unpack_from(b, 0)[0]
    parallel = mark in entropy.RANS_MARKS
    at = 4 if parallel else 0  # the u32 length of the zstd tables
    tlen = U32.unpack_from(b, at)[0]
    clen = U32.unpack_from(b, 8)[0] if mark == entropy.RANS_NIBBLE_MARK else 0
    head = 12 if mark == entropy.RANS_NIBBLE_MARK else at + 4
    tables_end = min(len(b), head + tlen)
    how = fdp.ConsumeIntInRange(0, 6)
    if how == 0:  # the tables: lo (i16) | width (u16) [| codes or counts (u8)], zstd
        new = mutate_zstd(fdp, bytes(b[head:tables_end]))
        return bytes(b[:at]) + U32.pack(len(new)) + bytes(b[at + 4 : head]) + new + \
            bytes(b[tables_end:])
    if how == 1:  # the format mark: dropped, swapped for another or added
        marks = list(entropy.RANS_MARKS)
        if parallel and fdp.ConsumeBool():
            return bytes(b[4:])
        if parallel:
            others = [m for m in marks if m != mark]
            return U32.pack(fdp.PickValueInList(others)) + bytes(b[4:])
        return U32.pack(fdp.PickValueInList(marks)) + bytes(b)
    if how == 5 and mark == entropy.RANS_NIBBLE_MARK:  # format 4's codes: length or bytes
        if fdp.ConsumeBool():
            b[8:12] = U32.pack(max(0, clen + fdp.ConsumeIntInRange(-2, 2)))
        elif clen:
            pos = tables_end + some_index(fdp, clen)
            if pos < len(b):
                b[pos] = fdp.PickValueInList([0, 0x0F, 0xF0, 0xFF, b[pos] ^ 0x10])
        return bytes(b)
    tables_end = min(len(b), tables_end + clen)
    sec = tables_end  # rANS: u32 block | u32 groups | u32 states[] | u32 gwords[] | u16[]
    if how == 2:
        field = sec + 4 * fdp.ConsumeIntInRange(0, 1)
        v = fdp.PickValueInList([0, 1, 2, 3, 31, 32, 33, 512, 1023, 1024, 1025, 1 << 20,
                                 (1 << 20) + 1, 2**32 - 1, some_int(fdp, 32)])
        b[field : field + 4] = U32.pack(v)
    elif how == 3:  # a state or a group's word count
        pos = sec + 8 + 4 * fdp.ConsumeIntInRange(0, 64)
        v = fdp.PickValueInList([0, 1, 0xFFFF, 0x10000, 0x10001, 2**31, 2**32 - 1,
                                 some_int(fdp, 32)])
        b[pos : pos + 4] = U32.pack(v)
    elif how == 4:  # words: rewrite one, or drop / add some at the end
        pos = sec + some_index(fdp, max(1, len(b) - sec))
        if fdp.ConsumeBool():
            b[pos : pos + 2] = some_int(fdp, 16).to_bytes(2, "little")
        elif fdp.ConsumeBool():
            del b[-2 * fdp.ConsumeIntInRange(1, 8):]
        else:
            b += fdp.ConsumeBytes(2 * fdp.ConsumeIntInRange(1, 8))
    else:
        b[tables_end:] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 128))
    return bytes(b)
