"""Structure-aware mutations shared by the fuzz targets (fuzz_container, fuzz_store).

A *case* is a container taken apart: its ``EntryHeader`` proto and its frames' bytes. The
mutations below edit the header's fields (tokens, start position, spans, layout numbers,
kept-channel lists, dtype, rope, codec mode/level/params, fingerprint) and the frames (prefix
fields, layer record headers, bodies, the sections and entropy blobs inside bodies, zstd
payloads, the list of frames itself); ``kdn.codec.format.seal`` then recomputes every
checksum, so whatever refuses the result is one of the checks behind the checksums. The seeds
are ``reseal_seeds``, the byte layout and the payload mutations ``reseal_bytes``.

Import this module after the target has imported kdn under ``atheris.instrument_imports``.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import zstandard
from reseal_bytes import (
    ENTROPY_SECTIONS,
    FDP,
    FRAME,
    RECORD,
    RECORD_BITS,
    SECTION_COUNT,
    U32,
    mutate_entropy,
    mutate_zstd,
    pack_sections_with_len,
    records,
    some_index,
    some_int,
    some_text,
    split_sections,
    unzstd,
)
from reseal_seeds import ALL_LEVELS, Seed

from kdn import codec
from kdn.codec import entropy
from kdn.codec import format as fmt
from kdn.codec.layouts import layout_from_proto
from kdn.errors import KDNError
from kdn.layout import DType, LayerLayout
from kdn.v1 import kdn_pb2 as pb


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
        lay = lays[some_index(fdp, len(lays))]
        name = fdp.PickValueInList(["kv_heads", "k_channels", "v_channels"])
        setattr(lay, name, some_int(fdp, 32, getattr(lay, name)))

    def _kept(self, fdp: FDP) -> None:
        lays = self.entry.layout.layers
        if not lays:
            return
        lay = lays[some_index(fdp, len(lays))]
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
            del lays[some_index(fdp, len(lays))]
        elif how == 1 and lays:
            i = some_index(fdp, len(lays))
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
            lay.dtype = some_text(fdp, ["float16", "bfloat16", "float32", "", "int8", "float64",
                                    "torch.float16", "FLOAT16"])
        elif how == 1:
            lay.head_dim = some_int(fdp, 32, lay.head_dim)
        elif how == 2:
            lay.rope.theta = fdp.PickValueInList([0.0, -1.0, float("nan"), float("inf"), 1e-300,
                                                  10000.0, 1e6, fdp.ConsumeRegularFloat()])
        elif how == 3:
            lay.rope.rotary_dim = some_int(fdp, 32, lay.rope.rotary_dim)
        elif how == 4:
            lay.model_fingerprint = some_text(fdp, ["", "fuzz-pruned", "fuzz-bf16", "x"])
        else:
            lay.model_name = some_text(fdp, ["", "model"])

    def _codec(self, fdp: FDP) -> None:
        c = self.entry.codec
        how = fdp.ConsumeIntInRange(0, 2)
        if how == 0:
            c.mode = some_text(fdp, [*codec.mode_names(), "", "RAW", "none"])
        elif how == 1:
            c.level = some_text(fdp, [*ALL_LEVELS, "x", "Default"])
        elif fdp.ConsumeBool():
            c.params[some_text(fdp, ["zstd_level", "bits", "k_step"])] = some_text(
                fdp, ["", "1", "x"])
        else:
            c.params.clear()

    def _spans(self, fdp: FDP) -> None:
        spans = self.entry.frames
        how = fdp.ConsumeIntInRange(0, 4)
        if how == 0 and spans:
            s = spans[some_index(fdp, len(spans))]
            if fdp.ConsumeBool():
                s.first_layer = some_int(fdp, 32, s.first_layer)
            else:
                s.num_layers = some_int(fdp, 32, s.num_layers)
        elif how == 1 and spans:
            del spans[some_index(fdp, len(spans))]
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
                recs.append(RECORD.pack(lay.kv_heads % 65536, tokens, lay.k_channels % 65536,
                                         lay.v_channels % 65536, len(body)) + body)
            payload = b"".join(recs)
            out.append(bytearray(FRAME.pack(fmt.FRAME_MAGIC, i % 65536,
                                             span.first_layer % 65536,
                                             span.num_layers % 65536, len(payload), 0)
                                 + payload))
        self.frames = out

    def _frame(self, fdp: FDP) -> tuple[int, bytearray] | None:
        if not self.frames:
            return None
        i = some_index(fdp, len(self.frames))
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
        j = some_index(fdp, len(recs))
        off, body = recs[j]
        layer = struct.unpack_from("<H", frame, 4)[0] + j
        layers = self.seed.ref.layout.layers
        return i, off, body, layers[min(layer, len(layers) - 1)]

    def _set_body(self, i: int, off: int, new: bytes) -> None:
        frame = self.frames[i]
        blen = RECORD.unpack_from(frame, off)[4]
        at = off + RECORD.size
        frame[at : at + blen] = new
        struct.pack_into("<I", frame, off + RECORD.size - 4, len(new))
        struct.pack_into("<I", frame, 8, len(frame) - FRAME.size)

    def _bytes(self, fdp: FDP) -> None:
        got = self._frame(fdp)
        if got is None:
            return
        _, frame = got
        how = fdp.ConsumeIntInRange(0, 4)
        pos = some_index(fdp, len(frame) + 1)
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
        fields = list(RECORD.unpack_from(self.frames[i], off))
        f = fdp.ConsumeIntInRange(0, 4)
        fields[f] = some_int(fdp, RECORD_BITS[f], fields[f])
        RECORD.pack_into(self.frames[i], off, *fields)

    def _body(self, fdp: FDP) -> None:
        got = self._record(fdp)
        if got is None:
            return
        i, off, body = got
        how = fdp.ConsumeIntInRange(0, 3)
        if how == 0:
            new = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 256))
        elif how == 1:
            new = body[: some_index(fdp, len(body) + 1)]
        elif how == 2:
            new = body + fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 64))
        else:
            new = mutate_zstd(fdp, body)
        self._set_body(i, off, new)


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
        mark = U32.unpack_from(b, 0)[0]
        nibbles = mark == entropy.RANS_NIBBLE_MARK and len(b) >= 12
        at = 4 if mark in entropy.RANS_MARKS else 0
        head = 12 if nibbles else at + 4
        end = min(len(b), head + U32.unpack_from(b, at)[0])
        clen = U32.unpack_from(b, 8)[0] if nibbles else 0
        tables = unzstd(b[head:end])
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
        r = some_index(fdp, streams)
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
            counts[r][some_index(fdp, len(counts[r]))] = fdp.ConsumeIntInRange(0, 255)
        else:
            t = some_index(fdp, streams)
            lo[r], width[r], counts[r] = lo[t], width[t], counts[t]
        raw = struct.pack(f"<{streams}h{streams}H", *lo, *width)
        if nibbles:  # codes above 15 do not fit a nibble: the largest code instead
            codes = entropy.pack_nibbles(np.minimum(np.frombuffer(b"".join(counts), np.uint8),
                                                    15))
            packed = zstandard.ZstdCompressor(level=1).compress(raw)
            secs[s] = b[:4] + U32.pack(len(packed)) + U32.pack(len(codes)) + packed + \
                codes + b[end + clen :]
        else:
            packed = zstandard.ZstdCompressor(level=1).compress(raw + b"".join(counts))
            secs[s] = b[:at] + U32.pack(len(packed)) + packed + b[end:]
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
        pos = size * some_index(fdp, len(secs[s]) // size)
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
        i = some_index(fdp, len(lays))
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
        s = some_index(fdp, count)
        how = fdp.ConsumeIntInRange(0, 5)
        if how == 0 and s in ENTROPY_SECTIONS.get(self.seed.mode, ()):
            secs[s] = mutate_entropy(fdp, secs[s])
        elif how == 1:
            secs[s] = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
        elif how == 2:
            secs[s] = secs[s][: some_index(fdp, len(secs[s]) + 1)]
        elif how == 3:
            t = some_index(fdp, count)
            secs[s], secs[t] = secs[t], secs[s]
        elif how == 4 and secs[s]:
            pos = some_index(fdp, len(secs[s]))
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
        i, j = some_index(fdp, len(fr)), some_index(fdp, len(fr))
        if how == 0:
            del fr[i]
        elif how == 1:
            fr.insert(i, bytearray(fr[j]))
        elif how == 2:
            fr[i], fr[j] = fr[j], fr[i]
        elif how == 3 and partner is not None and i < len(partner.frames):
            fr[i] = bytearray(partner.frames[i])  # resealed below: then it is this entry's
        elif len(fr[i]) >= FRAME.size:  # the prefix's index, first layer or layer count
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
                self.entry.layout_fingerprint = some_text(fdp, ["", "0" * 32])
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
