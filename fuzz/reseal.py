"""Seeds and structure-aware mutations shared by the fuzz targets (fuzz_container, fuzz_store).

A *case* is a container taken apart: its ``EntryHeader`` proto and its frames' bytes. The
mutations below edit the header's fields (tokens, start position, spans, layout numbers,
kept-channel lists, dtype, rope, codec mode/level/params, fingerprint) and the frames (prefix
fields, layer record headers, bodies, the sections and entropy blobs inside bodies, zstd
payloads, the list of frames itself); ``kdn.codec.format.seal`` then recomputes every
checksum, so whatever refuses the result is one of the checks behind the checksums.

Import this module after the target has imported kdn under ``atheris.instrument_imports``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import atheris
import numpy as np
import torch
import zstandard

from kdn import codec
from kdn.cache import KVCache
from kdn.codec import entropy
from kdn.codec import format as fmt
from kdn.codec.layouts import layout_from_proto
from kdn.codec.modes import get_mode
from kdn.errors import KDNError
from kdn.layout import DType, KVLayout, LayerLayout
from kdn.v1 import kdn_pb2 as pb

FDP = atheris.FuzzedDataProvider
_FRAME = struct.Struct("<2sHHHIL")  # magic, index, first layer, layer count, length, sum
_RECORD = struct.Struct("<HIHHI")  # kv_heads, tokens, k_channels, v_channels, body length
_RECORD_BITS = (16, 32, 16, 16, 32)
_U32 = struct.Struct("<I")

# ------------------------------------------------------------------ seeds

PRUNED = KVLayout("fuzz-pruned", (
    LayerLayout(2, 8, 4, tuple(range(0, 16, 2)), None),  # K and V channel counts differ
    LayerLayout(1, 3, 6, (1, 5, 9), tuple(range(10, 16))),
    LayerLayout(2, 16, 16),
), head_dim=16)
SMALL_BF16 = KVLayout("fuzz-bf16", (LayerLayout(1, 4, 2), LayerLayout(1, 2, 4)),
                      dtype=DType.BFLOAT16, head_dim=4)
TINY_F32 = KVLayout("fuzz-f32", (LayerLayout(1, 2, 2),), dtype=DType.FLOAT32, head_dim=2)

MODE_LEVELS = [(m, lv) for m in codec.mode_names() for lv in get_mode(m).levels]
"""Every codec mode with every level it has."""
ALL_LEVELS = sorted({lv for _, lv in MODE_LEVELS})
ENTROPY_SECTIONS = {"kdn": (2, 3), "cachegen": (2,)}
SECTION_COUNT = {"int8": 4, "kdn": 4, "cachegen": 3}

# (layout, tokens, modes) of the seeds; None: every mode and level. 1100 tokens: two rANS
# blocks per row; 1 token: kdn's sink only (empty entropy streams); 0 tokens: empty layers.
SHAPES: list[tuple[KVLayout, int, tuple[str, ...] | None]] = [
    (PRUNED, 5, None),
    (SMALL_BF16, 3, None),
    (TINY_F32, 1, None),
    (TINY_F32, 0, ("raw:", "lossless:", "int8:", "kdn:default", "cachegen:")),
    (TINY_F32, 1100, ("lossless:", "int8:", "kdn:default", "cachegen:")),
]


@dataclass
class Seed:
    name: str
    mode: str
    entry: pb.EntryHeader
    frames: list[bytes]
    blob: bytes
    ref: KVCache
    """What ``blob`` decodes to."""
    version: int = fmt.VERSION
    partner: int = -1
    """Index of a seed of the same layout, codec, tokens and grouping with other tensors."""

    @property
    def signature(self) -> bytes:
        return signature(self.entry, self.frames)


def signature(entry: pb.EntryHeader, frames: list[bytes] | list[bytearray]) -> bytes:
    """Everything that decides what a valid container decodes to: two containers that both
    decode and share this give the same tensors (records parse from the start of each frame,
    so equal concatenated payloads are equal records in the same order)."""
    try:
        fp = layout_from_proto(entry.layout).fingerprint
    except KDNError:
        fp = "?"
    head = f"{fp}|{entry.layout.dtype}|{entry.tokens}|{entry.start_position}|" \
           f"{entry.codec.mode}|{entry.codec.level}|".encode()
    return head + b"".join(bytes(f[_FRAME.size:]) for f in frames)


def _kv(layout: KVLayout, tokens: int, seed: int) -> KVCache:
    g = torch.Generator().manual_seed(seed)
    dt = layout.dtype.torch
    return KVCache(layout, [(
        (torch.randn(lay.kv_heads, tokens, lay.k_channels, generator=g) * 3).to(dt),
        (torch.randn(lay.kv_heads, tokens, lay.v_channels, generator=g) * 3).to(dt),
    ) for lay in layout.layers], start_position=seed * 7)


def _seed(name: str, mode: str, header: bytes, frames: list[bytes], kv: KVCache | None = None
          ) -> Seed:
    parsed = fmt.parse_header(header)
    blob = b"".join([header, *frames])
    seed = Seed(name, mode, parsed.entry, [bytes(f) for f in frames], blob, codec.decode(blob),
                version=parsed.version)
    if kv is not None and get_mode(mode).lossless and not same_tensors(seed.ref, kv):
        raise AssertionError(f"seed {name}: a lossless mode did not decode to its tensors")
    return seed


def _format1(blob: bytes, streams: int, n: int) -> bytes:
    """An entropy blob re-coded in the old sequential range-coder format (still read)."""
    if n == 0:
        return blob
    sym = entropy.decode_streams(blob, streams, n)
    lo, width, counts = entropy._tables(sym)
    tables = lo.astype("<i2").tobytes() + width.astype("<u2").tobytes() + counts.tobytes()
    packed = zstandard.ZstdCompressor(level=3).compress(tables)
    return _U32.pack(len(packed)) + packed + entropy._range_coded(sym, lo, width, counts)


def _old_entropy(seed: Seed) -> Seed:
    """``seed`` (kdn or cachegen) with every entropy blob in the format-1 layout."""
    layout, tokens = seed.ref.layout, int(seed.entry.tokens)
    frames = []
    layer = 0
    for frame in seed.frames:
        recs = []
        for off, body in records(frame):
            lay = layout.layers[layer]
            rows = lay.kv_heads * (lay.k_channels + lay.v_channels)
            secs = split_sections(body, SECTION_COUNT[seed.mode])
            assert secs is not None
            if seed.mode == "kdn":
                n = tokens - min(1, tokens)
                secs[2], secs[3] = _format1(secs[2], 2, n), _format1(secs[3], rows, n)
            else:
                secs[2] = _format1(secs[2], rows, tokens)
            recs.append(frame[off : off + _RECORD.size - 4] + pack_sections_with_len(secs))
            layer += 1
        frames.append(_with_payload(frame, b"".join(recs)))
    header, sealed = fmt.seal(seed.entry, frames)
    out = _seed(seed.name + "/format1", seed.mode, header, sealed)
    assert all(torch.equal(a, b) for (ka, va), (kb, vb) in zip(out.ref.layers, seed.ref.layers)
               for a, b in ((ka, kb), (va, vb))), "format-1 re-coding changed the tensors"
    return out


def build_seeds() -> list[Seed]:
    seeds: list[Seed] = []
    for layout, tokens, modes in SHAPES:
        for mode, level in MODE_LEVELS:
            if modes is not None and f"{mode}:{level}" not in modes:
                continue
            for lpf in (1, 0):
                name = f"{layout.model_fingerprint}/{tokens}/{mode}:{level}/lpf{lpf}"
                pair = []
                for g in (1, 2):
                    kv = _kv(layout, tokens, g)
                    parts = codec.encode_parts(kv, mode, level, layers_per_frame=lpf)
                    pair.append(_seed(f"{name}/{g}", mode, parts.header, parts.frames, kv))
                pair[0].partner, pair[1].partner = len(seeds) + 1, len(seeds)
                seeds += pair
    extra = []
    for s in seeds[::2]:
        if s.name.endswith("lpf1/1"):  # version 1: frames bound to the header, not the entry
            header, frames = fmt.seal(s.entry, s.frames, version=1)
            extra.append(_seed(s.name + "/v1", s.mode, header, frames))
        if s.mode in ENTROPY_SECTIONS and s.name.endswith("/1") and s.entry.tokens > 1:
            extra.append(_old_entropy(s))
    return seeds + extra


# ------------------------------------------------------------------ byte-level helpers


def records(frame: bytes | bytearray) -> list[tuple[int, bytes]]:
    """(offset in the frame, body) of each whole record, as far as the bytes parse."""
    out = []
    off = _FRAME.size
    while off + _RECORD.size <= len(frame):
        blen = _RECORD.unpack_from(frame, off)[4]
        at = off + _RECORD.size
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
    return _U32.pack(len(body)) + body


def _with_payload(frame: bytes | bytearray, payload: bytes) -> bytearray:
    head = bytearray(frame[: _FRAME.size].ljust(_FRAME.size, b"\0"))
    struct.pack_into("<I", head, 8, len(payload))
    return head + payload


def _unzstd(blob: bytes) -> bytes | None:
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


def _text(fdp: FDP, choices: list[str]) -> str:
    if fdp.ConsumeIntInRange(0, 3):
        return str(fdp.PickValueInList(choices))
    return str(fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 12)))


def _index(fdp: FDP, n: int) -> int:
    return fdp.ConsumeIntInRange(0, n - 1) if n else 0


# ------------------------------------------------------------------ mutations


class Case:
    """A seed taken apart, mutated in place, then resealed."""

    def __init__(self, seed: Seed) -> None:
        self.seed = seed
        self.entry = pb.EntryHeader()
        self.entry.CopyFrom(seed.entry)
        self.frames = [bytearray(f) for f in seed.frames]
        self.version = seed.version

    # -- header ---------------------------------------------------------------------------------

    def _layer_field(self, fdp: FDP) -> None:
        lays = self.entry.layout.layers
        if not lays:
            return
        lay = lays[_index(fdp, len(lays))]
        name = fdp.PickValueInList(["kv_heads", "k_channels", "v_channels"])
        setattr(lay, name, some_int(fdp, 32, getattr(lay, name)))

    def _kept(self, fdp: FDP) -> None:
        lays = self.entry.layout.layers
        if not lays:
            return
        lay = lays[_index(fdp, len(lays))]
        which = fdp.PickValueInList(["k", "v"])
        how = fdp.ConsumeIntInRange(0, 3)
        if how == 0:
            setattr(lay, f"has_{which}_kept", not getattr(lay, f"has_{which}_kept"))
            return
        n = fdp.ConsumeIntInRange(0, 24)
        if how == 1:  # ascending, as a real pruned layout has
            start, step = fdp.ConsumeIntInRange(0, 8), fdp.ConsumeIntInRange(1, 3)
            kept = list(range(start, start + n * step, step))
        else:
            kept = [some_int(fdp, 32) for _ in range(n)]
        del getattr(lay, f"{which}_kept")[:]
        getattr(lay, f"{which}_kept").extend(kept)
        setattr(lay, f"has_{which}_kept", True)
        if fdp.ConsumeBool():
            setattr(lay, f"{which}_channels", n)

    def _layers(self, fdp: FDP) -> None:
        lays = self.entry.layout.layers
        how = fdp.ConsumeIntInRange(0, 3)
        if how == 0 and lays:
            del lays[_index(fdp, len(lays))]
        elif how == 1 and lays:
            i = _index(fdp, len(lays))
            for _ in range(fdp.ConsumeIntInRange(1, 300)):
                lays.add().CopyFrom(lays[i])
        elif how == 2:
            del lays[:]
        else:
            lays.add(kv_heads=some_int(fdp, 32), k_channels=some_int(fdp, 32),
                     v_channels=some_int(fdp, 32))

    def _layout_misc(self, fdp: FDP) -> None:
        lay = self.entry.layout
        how = fdp.ConsumeIntInRange(0, 5)
        if how == 0:
            lay.dtype = _text(fdp, ["float16", "bfloat16", "float32", "", "int8", "float64",
                                    "torch.float16", "FLOAT16"])
        elif how == 1:
            lay.head_dim = some_int(fdp, 32, lay.head_dim)
        elif how == 2:
            lay.rope.theta = fdp.PickValueInList([0.0, -1.0, float("nan"), float("inf"), 1e-300,
                                                  10000.0, 1e6, fdp.ConsumeRegularFloat()])
        elif how == 3:
            lay.rope.rotary_dim = some_int(fdp, 32, lay.rope.rotary_dim)
        elif how == 4:
            lay.model_fingerprint = _text(fdp, ["", "fuzz-pruned", "fuzz-bf16", "x"])
        else:
            lay.model_name = _text(fdp, ["", "model"])

    def _codec(self, fdp: FDP) -> None:
        c = self.entry.codec
        how = fdp.ConsumeIntInRange(0, 2)
        if how == 0:
            c.mode = _text(fdp, [*codec.mode_names(), "", "RAW", "none"])
        elif how == 1:
            c.level = _text(fdp, [*ALL_LEVELS, "x", "Default"])
        elif fdp.ConsumeBool():
            c.params[_text(fdp, ["zstd_level", "bits", "k_step"])] = _text(fdp, ["", "1", "x"])
        else:
            c.params.clear()

    def _spans(self, fdp: FDP) -> None:
        spans = self.entry.frames
        how = fdp.ConsumeIntInRange(0, 4)
        if how == 0 and spans:
            s = spans[_index(fdp, len(spans))]
            if fdp.ConsumeBool():
                s.first_layer = some_int(fdp, 32, s.first_layer)
            else:
                s.num_layers = some_int(fdp, 32, s.num_layers)
        elif how == 1 and spans:
            del spans[_index(fdp, len(spans))]
        elif how == 2:
            spans.add(first_layer=some_int(fdp, 32), num_layers=some_int(fdp, 32))
        else:  # a consistent regrouping: one layer per frame, or chunks of k
            n = len(self.entry.layout.layers)
            k = 1 if how == 3 else fdp.ConsumeIntInRange(1, max(1, n))
            del spans[:]
            for first in range(0, n, k):
                spans.add(first_layer=first, num_layers=min(k, n - first))

    # -- frames ---------------------------------------------------------------------------------

    def conform(self) -> None:
        """Rebuild the frames from their records (bodies kept, in order) so that prefixes and
        record shapes agree with the header: header mutations reach the mode decoders."""
        bodies = [body for f in self.frames for _, body in records(f)]
        lays = self.entry.layout.layers
        tokens = self.entry.tokens % (1 << 32)
        out: list[bytearray] = []
        at = 0
        for i, span in enumerate(self.entry.frames[:1100]):
            recs = []
            for j in range(min(span.num_layers, len(lays) + 2)):
                layer = span.first_layer + j
                lay = lays[layer] if layer < len(lays) else pb.LayerLayout()
                body = bodies[at] if at < len(bodies) else b""
                at += 1
                recs.append(_RECORD.pack(lay.kv_heads % 65536, tokens, lay.k_channels % 65536,
                                         lay.v_channels % 65536, len(body)) + body)
            payload = b"".join(recs)
            out.append(bytearray(_FRAME.pack(fmt.FRAME_MAGIC, i % 65536,
                                             span.first_layer % 65536,
                                             span.num_layers % 65536, len(payload), 0)
                                 + payload))
        self.frames = out

    def _frame(self, fdp: FDP) -> tuple[int, bytearray] | None:
        if not self.frames:
            return None
        i = _index(fdp, len(self.frames))
        return i, self.frames[i]

    def _record(self, fdp: FDP) -> tuple[int, int, bytes] | None:
        """(frame index, record offset, body) of a record."""
        got = self._layer_record(fdp)
        return None if got is None else got[:3]

    def _layer_record(self, fdp: FDP) -> tuple[int, int, bytes, LayerLayout] | None:
        """(frame index, record offset, body, the seed layout's layer it was encoded for)."""
        got = self._frame(fdp)
        if got is None:
            return None
        i, frame = got
        recs = records(frame)
        if not recs:
            return None
        j = _index(fdp, len(recs))
        off, body = recs[j]
        layer = struct.unpack_from("<H", frame, 4)[0] + j
        layers = self.seed.ref.layout.layers
        return i, off, body, layers[min(layer, len(layers) - 1)]

    def _set_body(self, i: int, off: int, new: bytes) -> None:
        frame = self.frames[i]
        blen = _RECORD.unpack_from(frame, off)[4]
        at = off + _RECORD.size
        frame[at : at + blen] = new
        struct.pack_into("<I", frame, off + _RECORD.size - 4, len(new))
        struct.pack_into("<I", frame, 8, len(frame) - _FRAME.size)

    def _bytes(self, fdp: FDP) -> None:
        got = self._frame(fdp)
        if got is None:
            return
        _, frame = got
        how = fdp.ConsumeIntInRange(0, 4)
        pos = _index(fdp, len(frame) + 1)
        if how == 0 and pos < len(frame):
            frame[pos] = fdp.ConsumeIntInRange(0, 255)
        elif how == 1:
            width = fdp.PickValueInList([2, 4])
            v = some_int(fdp, 8 * width)
            frame[pos : pos + width] = v.to_bytes(width, "little")
        elif how == 2:
            frame[pos:pos] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 32))
        elif how == 3:
            del frame[pos : pos + fdp.ConsumeIntInRange(1, 64)]
        else:
            del frame[pos:]

    def _record_field(self, fdp: FDP) -> None:
        got = self._record(fdp)
        if got is None:
            return
        i, off, _ = got
        fields = list(_RECORD.unpack_from(self.frames[i], off))
        f = fdp.ConsumeIntInRange(0, 4)
        fields[f] = some_int(fdp, _RECORD_BITS[f], fields[f])
        _RECORD.pack_into(self.frames[i], off, *fields)

    def _body(self, fdp: FDP) -> None:
        got = self._record(fdp)
        if got is None:
            return
        i, off, body = got
        how = fdp.ConsumeIntInRange(0, 3)
        if how == 0:
            new = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256))
        elif how == 1:
            new = body[: _index(fdp, len(body) + 1)]
        elif how == 2:
            new = body + fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 64))
        else:
            new = self._zstd(fdp, body)
        self._set_body(i, off, new)

    def _zstd(self, fdp: FDP, blob: bytes) -> bytes:
        """``blob`` (zstd) decompressed, mutated and compressed again (its frame is valid)."""
        got = _unzstd(blob)
        if got is None:
            return blob
        raw = bytearray(got)
        how = fdp.ConsumeIntInRange(0, 3)
        pos = _index(fdp, len(raw) + 1)
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

    def _entropy(self, fdp: FDP, blob: bytes) -> bytes:
        """A structural mutation of an entropy blob (``kdn.codec.entropy`` / ``rans``)."""
        b = bytearray(blob)
        if len(b) < 12:
            return bytes(b) + fdp.ConsumeBytes(12)
        mark = _U32.unpack_from(b, 0)[0]
        parallel = mark in entropy.RANS_MARKS
        at = 4 if parallel else 0  # the u32 length of the zstd tables
        tlen = _U32.unpack_from(b, at)[0]
        clen = _U32.unpack_from(b, 8)[0] if mark == entropy.RANS_NIBBLE_MARK else 0
        head = 12 if mark == entropy.RANS_NIBBLE_MARK else at + 4
        tables_end = min(len(b), head + tlen)
        how = fdp.ConsumeIntInRange(0, 6)
        if how == 0:  # the tables: lo (i16) | width (u16) [| codes or counts (u8)], zstd
            new = self._zstd(fdp, bytes(b[head:tables_end]))
            return bytes(b[:at]) + _U32.pack(len(new)) + bytes(b[at + 4 : head]) + new + \
                bytes(b[tables_end:])
        if how == 1:  # the format mark: dropped, swapped for another or added
            marks = list(entropy.RANS_MARKS)
            if parallel and fdp.ConsumeBool():
                return bytes(b[4:])
            if parallel:
                others = [m for m in marks if m != mark]
                return _U32.pack(fdp.PickValueInList(others)) + bytes(b[4:])
            return _U32.pack(fdp.PickValueInList(marks)) + bytes(b)
        if how == 5 and mark == entropy.RANS_NIBBLE_MARK:  # format 4's codes: length or bytes
            if fdp.ConsumeBool():
                b[8:12] = _U32.pack(max(0, clen + fdp.ConsumeIntInRange(-2, 2)))
            elif clen:
                pos = tables_end + _index(fdp, clen)
                if pos < len(b):
                    b[pos] = fdp.PickValueInList([0, 0x0F, 0xF0, 0xFF, b[pos] ^ 0x10])
            return bytes(b)
        tables_end = min(len(b), tables_end + clen)
        sec = tables_end  # rANS: u32 block | u32 groups | u32 states[] | u32 gwords[] | u16[]
        if how == 2:
            field = sec + 4 * fdp.ConsumeIntInRange(0, 1)
            v = fdp.PickValueInList([0, 1, 2, 3, 31, 32, 33, 512, 1023, 1024, 1025, 1 << 20,
                                     (1 << 20) + 1, 2**32 - 1, some_int(fdp, 32)])
            b[field : field + 4] = _U32.pack(v)
        elif how == 3:  # a state or a group's word count
            pos = sec + 8 + 4 * fdp.ConsumeIntInRange(0, 64)
            v = fdp.PickValueInList([0, 1, 0xFFFF, 0x10000, 0x10001, 2**31, 2**32 - 1,
                                     some_int(fdp, 32)])
            b[pos : pos + 4] = _U32.pack(v)
        elif how == 4:  # words: rewrite one, or drop / add some at the end
            pos = sec + _index(fdp, max(1, len(b) - sec))
            if fdp.ConsumeBool():
                b[pos : pos + 2] = some_int(fdp, 16).to_bytes(2, "little")
            elif fdp.ConsumeBool():
                del b[-2 * fdp.ConsumeIntInRange(1, 8):]
            else:
                b += fdp.ConsumeBytes(2 * fdp.ConsumeIntInRange(1, 8))
        else:
            b[tables_end:] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 128))
        return bytes(b)

    def _tables(self, fdp: FDP) -> None:
        """Edit one row of an entropy blob's model (its lo, its width with the counts resized
        to match, its counts), the tables compressed again so they parse."""
        got = self._layer_record(fdp)
        secs_at = ENTROPY_SECTIONS.get(self.seed.mode)
        if got is None or secs_at is None:
            return
        i, off, body, lay = got
        secs = split_sections(body, SECTION_COUNT[self.seed.mode])
        if secs is None:
            return
        s = fdp.PickValueInList(list(secs_at))
        streams = 2 if (self.seed.mode, s) == ("kdn", 2) else \
            lay.kv_heads * (lay.k_channels + lay.v_channels)
        b = secs[s]
        if len(b) < 8:
            return
        mark = _U32.unpack_from(b, 0)[0]
        nibbles = mark == entropy.RANS_NIBBLE_MARK and len(b) >= 12
        at = 4 if mark in entropy.RANS_MARKS else 0
        head = 12 if nibbles else at + 4
        end = min(len(b), head + _U32.unpack_from(b, at)[0])
        clen = _U32.unpack_from(b, 8)[0] if nibbles else 0
        tables = _unzstd(b[head:end])
        if tables is None or len(tables) < 4 * streams:
            return
        lo = list(struct.unpack_from(f"<{streams}h", tables))
        width = list(struct.unpack_from(f"<{streams}H", tables, 2 * streams))
        if nibbles:  # format 4: the codes after the tables, two to a byte
            packed_codes = np.frombuffer(b[end : end + clen], np.uint8)
            tables = tables[: 4 * streams] + np.stack(
                [packed_codes & 15, packed_codes >> 4], axis=1).ravel().tobytes()
        starts = [sum(width[:r]) for r in range(streams)]
        counts = [bytearray(tables[4 * streams + a : 4 * streams + a + w])
                  for a, w in zip(starts, width)]
        r = _index(fdp, streams)
        how = fdp.ConsumeIntInRange(0, 3)
        if how == 0:
            lo[r] = fdp.PickValueInList([-32768, -4001, -4000, -2049, -2048, -1, 0, 1, 2032,
                                         2047, 2048, 2049, 2100, 4000, 4001, 32767,
                                         lo[r] + fdp.ConsumeIntInRange(-8, 8)])
            lo[r] = max(-32768, min(32767, lo[r]))
        elif how == 1:
            width[r] = fdp.PickValueInList([0, 1, 2, 3, 255, 256, 32767, 32768, 32769, 65535,
                                            width[r] + fdp.ConsumeIntInRange(-4, 4)]) % 65536
            counts[r] = (counts[r] + bytes([fdp.ConsumeIntInRange(0, 255)]) * width[r]
                         )[: width[r]] if fdp.ConsumeBool() else counts[r]
        elif how == 2 and counts[r]:
            fill = fdp.PickValueInList([0, 1, 255])
            counts[r] = bytearray([fill]) * len(counts[r])
            counts[r][_index(fdp, len(counts[r]))] = fdp.ConsumeIntInRange(0, 255)
        else:
            t = _index(fdp, streams)
            lo[r], width[r], counts[r] = lo[t], width[t], counts[t]
        raw = struct.pack(f"<{streams}h{streams}H", *lo, *width)
        if nibbles:  # codes above 15 do not fit a nibble: the largest code instead
            codes = entropy.pack_nibbles(np.minimum(np.frombuffer(b"".join(counts), np.uint8),
                                                    15))
            packed = zstandard.ZstdCompressor(level=1).compress(raw)
            secs[s] = b[:4] + _U32.pack(len(packed)) + _U32.pack(len(codes)) + packed + \
                codes + b[end + clen :]
        else:
            packed = zstandard.ZstdCompressor(level=1).compress(raw + b"".join(counts))
            secs[s] = b[:at] + _U32.pack(len(packed)) + packed + b[end:]
        self._set_body(i, off, pack_sections_with_len(secs)[4:])

    def _scales(self, fdp: FDP) -> None:
        """A special float in a section stored as floats (int8 and cachegen scales, kdn sinks)."""
        where = {"int8": (0, 2), "cachegen": (0, 1), "kdn": (0, 1)}.get(self.seed.mode)
        got = self._record(fdp)
        if got is None or where is None:
            return
        i, off, body = got
        secs = split_sections(body, SECTION_COUNT[self.seed.mode])
        if secs is None:
            return
        s = fdp.PickValueInList(list(where))
        size = self.seed.ref.layout.dtype.itemsize if self.seed.mode == "kdn" else 2
        if len(secs[s]) < size:
            return
        pos = size * _index(fdp, len(secs[s]) // size)
        value = fdp.PickValueInList([float("inf"), float("-inf"), float("nan"), 65504.0,
                                     -65504.0, 0.0, -0.0, 6e-8, 1.0, 3e38])
        if size == 4:
            new = struct.pack("<f", value)
        elif self.seed.mode == "kdn" and self.seed.ref.layout.dtype is DType.BFLOAT16:
            new = struct.pack("<f", value)[2:]  # bf16: the high half of a float32
        else:
            new = struct.pack("<e", max(-65504.0, min(65504.0, value))
                              if math.isfinite(value) else value)
        secs[s] = secs[s][:pos] + new + secs[s][pos + size :]
        self._set_body(i, off, pack_sections_with_len(secs)[4:])

    def _grow(self, fdp: FDP) -> None:
        """A deep model: a layer repeated many times, with a big token count and frames that
        cover every layer (in chunks), so the declared sizes reach the decoders."""
        lays = self.entry.layout.layers
        if not lays:
            return
        i = _index(fdp, len(lays))
        for _ in range(fdp.PickValueInList([8, 64, 300])):
            lays.add().CopyFrom(lays[i])
        self.entry.tokens = fdp.PickValueInList([self.entry.tokens, 1 << 20, 1 << 24, 1 << 25])
        n = len(lays)
        k = max(1, -(-n // fdp.PickValueInList([1, 4, 16, 64])))
        del self.entry.frames[:]
        for first in range(0, n, k):
            self.entry.frames.add(first_layer=first, num_layers=min(k, n - first))

    def _sections(self, fdp: FDP) -> None:
        count = SECTION_COUNT.get(self.seed.mode)
        got = self._record(fdp)
        if count is None or got is None:
            return
        i, off, body = got
        secs = split_sections(body, count)
        if secs is None:
            return
        s = _index(fdp, count)
        how = fdp.ConsumeIntInRange(0, 5)
        if how == 0 and s in ENTROPY_SECTIONS.get(self.seed.mode, ()):
            secs[s] = self._entropy(fdp, secs[s])
        elif how == 1:
            secs[s] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        elif how == 2:
            secs[s] = secs[s][: _index(fdp, len(secs[s]) + 1)]
        elif how == 3:
            t = _index(fdp, count)
            secs[s], secs[t] = secs[t], secs[s]
        elif how == 4 and secs[s]:
            pos = _index(fdp, len(secs[s]))
            secs[s] = secs[s][:pos] + bytes([fdp.ConsumeIntInRange(0, 255)]) + secs[s][pos + 1:]
        else:  # a lying section table over the same bytes
            new = bytearray(pack_sections_with_len(secs)[4:])
            struct.pack_into("<I", new, 4 * s, some_int(fdp, 32, len(secs[s])))
            self._set_body(i, off, bytes(new))
            return
        self._set_body(i, off, pack_sections_with_len(secs)[4:])

    def _frame_list(self, fdp: FDP, partner: Seed | None) -> None:
        fr = self.frames
        how = fdp.ConsumeIntInRange(0, 4)
        if not fr:
            return
        i, j = _index(fdp, len(fr)), _index(fdp, len(fr))
        if how == 0:
            del fr[i]
        elif how == 1:
            fr.insert(i, bytearray(fr[j]))
        elif how == 2:
            fr[i], fr[j] = fr[j], fr[i]
        elif how == 3 and partner is not None and i < len(partner.frames):
            fr[i] = bytearray(partner.frames[i])  # resealed below: then it is this entry's
        elif len(fr[i]) >= _FRAME.size:  # the prefix's index, first layer or layer count
            struct.pack_into("<H", fr[i], 2 + 2 * fdp.ConsumeIntInRange(0, 2),
                             some_int(fdp, 16, i))

    def mutate(self, fdp: FDP, partner: Seed | None = None) -> None:
        header_ops = 0
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            op = fdp.ConsumeIntInRange(0, 18)
            header_ops += op <= 8 or op == 17
            if op == 0:
                self.entry.tokens = some_int(fdp, 64, self.entry.tokens)
            elif op == 1:
                self.entry.start_position = some_int(fdp, 64, self.entry.start_position)
            elif op == 2:
                self._layer_field(fdp)
            elif op == 3:
                self._kept(fdp)
            elif op == 4:
                self._layers(fdp)
            elif op == 5:
                self._layout_misc(fdp)
            elif op == 6:
                self._codec(fdp)
            elif op == 7:
                self._spans(fdp)
            elif op == 8:
                self.entry.layout_fingerprint = _text(fdp, ["", "0" * 32])
            elif op == 9:
                self._bytes(fdp)
            elif op == 10:
                self._record_field(fdp)
            elif op == 11:
                self._body(fdp)
            elif op == 12:
                self._sections(fdp)
            elif op == 13:
                self._frame_list(fdp, partner)
            elif op == 14:
                self.conform()
            elif op == 15:
                self._tables(fdp)
            elif op == 16:
                self._scales(fdp)
            elif op == 17:
                self._grow(fdp)
            elif self.version == 2 and fdp.ConsumeBool():
                self.version = 1
        if fdp.ConsumeIntInRange(0, 7) != 7:  # usually the fingerprint follows the layout
            try:
                self.entry.layout_fingerprint = layout_from_proto(self.entry.layout).fingerprint
            except KDNError:
                pass
        # after header edits, usually: records follow the header, so bodies reach the decoders
        # (frame edits are kept as they are, mostly)
        if fdp.ConsumeIntInRange(0, 7) < (6 if header_ops else 1):
            self.conform()

    def seal(self) -> tuple[bytes, list[bytes]]:
        """The header and frames with every checksum recomputed (raises KDNError where a
        version-1 header does not parse: its frame sums are seeded with its checksum)."""
        return fmt.seal(self.entry, [bytes(f) for f in self.frames], self.version)


def declared_shapes(entry: pb.EntryHeader) -> tuple[KVLayout, list[tuple[tuple[int, ...], ...]]]:
    """The layout a (mutated) header declares and each layer's (K shape, V shape)."""
    layout = layout_from_proto(entry.layout)
    t = int(entry.tokens)
    return layout, [((lay.kv_heads, t, lay.k_channels), (lay.kv_heads, t, lay.v_channels))
                    for lay in layout.layers]


_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def same_tensors(a: KVCache, b: KVCache) -> bool:
    """Bit-identical layers (NaN payloads included) and the same start position."""
    return a.start_position == b.start_position and len(a.layers) == len(b.layers) and all(
        x.dtype == y.dtype and x.shape == y.shape
        and torch.equal(x.contiguous().view(_BITS[x.dtype]), y.contiguous().view(_BITS[y.dtype]))
        for (ka, va), (kb, vb) in zip(a.layers, b.layers) for x, y in ((ka, kb), (va, vb)))
