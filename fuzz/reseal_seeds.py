"""The seeds of the fuzz targets and what they compare a decode with: valid containers of every
codec mode and level on pruned, bf16 and f32 layouts (version-1 containers and format-1 entropy
blobs too), each with the tensors it decodes to; ``signature`` (what decides a decode),
``declared_shapes`` and ``same_tensors``.

Import this module after the target has imported kdn under ``atheris.instrument_imports``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import zstandard
from reseal_bytes import (
    ENTROPY_SECTIONS,
    FRAME,
    RECORD,
    SECTION_COUNT,
    U32,
    pack_sections_with_len,
    records,
    split_sections,
    with_payload,
)

from kdn import codec
from kdn.cache import KVCache
from kdn.codec import api, entropy
from kdn.codec import format as fmt
from kdn.codec.layouts import layout_from_proto
from kdn.codec.modes import get_mode
from kdn.errors import KDNError
from kdn.layout import DType, KVLayout, LayerLayout
from kdn.v1 import kdn_pb2 as pb

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

# (layout, tokens, modes) of the seeds; None: every mode and level. 1100 tokens: two rANS
# blocks per row; 1 token: kdn's sink only (empty entropy streams); 0 tokens: empty layers
# (which no client stores, and a hostile one may send: built past the encoder's check).
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
    return head + b"".join(bytes(f[FRAME.size:]) for f in frames)


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
    return U32.pack(len(packed)) + packed + entropy._range_coded(sym, lo, width, counts)


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
            recs.append(frame[off : off + RECORD.size - 4] + pack_sections_with_len(secs))
            layer += 1
        frames.append(with_payload(frame, b"".join(recs)))
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
                    parts = codec.encode_parts(kv, mode, level, layers_per_frame=lpf) \
                        if tokens else api._encode_unchecked(kv, mode, level, lpf, False)  # noqa: SLF001
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
