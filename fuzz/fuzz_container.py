"""atheris fuzz target: container parsing, frame checks and every mode decoder, past the checksums.

    python fuzz/fuzz_container.py -runs=100000        # or -max_total_time=600
    python fuzz/fuzz_container.py -max_total_time=60 -print_final_stats=1 corpus/   # keep a corpus

Seeds (``fuzz/reseal_seeds.py``): every codec mode and level, a pruned layout (layers whose K and V
channel counts differ, k_kept/v_kept lists), bf16 and f32 layouts, 0/1/5/1100 tokens, frames
of one layer and of ``layers_per_frame=0``, version-1 containers and old (format-1) entropy
blobs. Each input picks a seed and a strategy:

- reseal (most inputs): mutate the header's fields and the frames' bytes, then
  ``kdn.codec.format.seal`` so every checksum is right, then decode (whole container, frame by
  frame in any order, or borrowing writable frames);
- byte mutations without resealing (the checksums must refuse them);
- splicing frames of two seeds of one layout with their stale sums (must be refused: entries
  are bound end to end, container version 2);
- arbitrary bytes.

Oracles: an exception that is not a ``KDNError`` is a finding; an unmutated seed decodes to its
tensors; a decode that succeeds returns exactly the layers, shapes, dtype and start position
the (mutated) header declares, bit-identical to the seed's tensors when nothing that decides
them changed, finite where the mode guarantees it (int8, cachegen: every value; kdn: every
token after the sinks), and the
server's structural checks (``parse_container(verify=True)``, ``copy_checked``) accept it too.
A resealed mutation of a body may decode to other values: once resealed that is the entry its
writer wrote, not a fault.

Measured 2026-11-23 (atheris 3.0, Python 3.11, one process on a 2-core machine shared with
other engineers' jobs, load average 1.2-1.6, so absolute rates are low):

- 10-minute run (``-max_total_time=600 -seed=11``, empty corpus): 577,620 inputs, 961/s on
  average (~2,000/s in the first seconds, before inputs grow), 369 coverage edges (1,839
  features), 280 corpus entries, peak RSS 1.1 GB; found nothing. The old target (raw and
  lossless seeds, byte flips only) plateaued at 156 edges and 17 entries in 4 minutes.
- The suite's run (``-runs=20000 -seed=1``) took ~13 s then, start-up (seeds) included; 40-46 s on
  2026-11-30 (a loaded machine, and a larger corpus as the target reaches more of the decoders).
- Found while building it (by the target, its seeds or its oracles; each fixed, with a test
  in tests/test_hostile.py): kdn scale symbols under the old |q| <= 4000 bound but beyond
  float32 decoded to NaN; int8/cachegen wrote infinite float16 scales for bf16/f32 values
  beyond float16's range (NaN tokens); a raw header declaring deep, long layers made decode()
  allocate its whole arena up front (MemoryError for 300 GiB); zstd frames (lossless bodies,
  entropy tables) declaring a huge content size were allocated at that size whatever
  max_output_size said (MemoryError; found by a 10-minute run at 60 k inputs); raw encode of a
  0-token cache raised TypeError. Run on the code before the fixes, the target finds the NaN
  and the arena within 150 s each.
- Found by the finite-values oracle of int8 and cachegen (2026-11-29, ``-seed=1``, at 12,430
  inputs, ~35 s): int8's decoders refused infinite float16 scales but took a NaN one, whose
  row decoded as NaN on the CPU (and as clamped garbage on the whole-entry decoder);
  cachegen took a NaN scale as 1. Both now refuse a scale that is not finite.
- Found by the suite's run (2026-11-30, ``-seed=1``, at ~11,600 inputs): a resealed kdn
  header declaring 33,554,432 tokens over a 4 KB frame of 302 layers; the range decoder ran
  12 s and reached 3.2 GB on its first layer before refusing it. ``entropy.parse_tables`` now
  refuses a payload shorter than its tables' information bound for the declared symbols (and
  a row whose end bins count nothing) before any decoding.
- Found by a 5-minute run (2026-11-30, ``-seed=2``, a 7 s slow unit): a resealed 1-token
  cachegen entry (constant symbol rows: no payload) declaring 33,554,432 tokens over 9 layers
  made [rows, tokens] symbols (4 s, +512 MB) before its 2-byte scale sections were found short;
  cachegen checks the scales first. Found reading for amplification (2026-11-30): a rANS
  section of 1-symbol blocks declared a stream a token, planned at 16 bytes a stream before its
  4 state bytes a stream were found missing (12 KB, 33M tokens: 6.8 s, 770 MB);
  ``rans.check_section`` counts them first. A 0-token kdn or cachegen layer of 65535 heads x
  65535 + 65535 channels (an entry of 300 bytes the encoder writes) made its 8.6e9 streams'
  empty tables as arrays: MemoryError; ``parse_tables`` gives views of one value for them.
  The rANS decoders built a 2 KB bucket table for every row, constant ones (no stream, no
  payload, tables zstd keeps in bytes) included: 1M of them beside one coded row over 2
  tokens, a 331-byte blob, took 55 s and 3.1 GB; ``rans.lookup`` covers coded rows only.
"""

from __future__ import annotations

import sys

import atheris

# not instrumented: coverage is wanted in kdn's own code (and numba compiles kdn.codec.rans)
import numpy  # noqa: F401
import torch
import zstandard  # noqa: F401

with atheris.instrument_imports(include=["kdn"], exclude=["kdn.codec.rans", "kdn.codec.gpu"]):
    from kdn import codec
    from kdn.cache import KVCache
    from kdn.codec import StreamDecoder, copies
    from kdn.codec import format as fmt
    from kdn.codec.modes.kdn import LEVELS as KDN_LEVELS
    from kdn.errors import KDNError

    codec.mode_names()  # the mode modules load on first use: here, instrumented

import reseal  # noqa: E402  (after kdn is imported instrumented)
import reseal_seeds  # noqa: E402  (after kdn is imported instrumented)

SEEDS = reseal_seeds.build_seeds()
QUANTIZED = ("kdn", "int8", "cachegen")
"""Lossy modes whose every decoded value is a symbol times a scale (kdn: every token after
its sinks, which it keeps as written): a successful decode of them is finite. raw and
lossless give back whatever was written, non-finite values included."""


def _decode(fdp: atheris.FuzzedDataProvider, header: bytes, frames: list[bytes]
            ) -> KVCache | None:
    """Decode one of three ways; None where a frame-by-frame decode left layers missing."""
    path = fdp.ConsumeIntInRange(0, 2)
    if path == 0:
        return codec.decode(b"".join([header, *frames]))
    dec = StreamDecoder(header, borrow=path == 2)
    order = list(range(len(frames)))
    if fdp.ConsumeBool():
        order.reverse()
    layers = dec.empty_cache()
    for i in order:
        frame = bytearray(frames[i]) if path == 2 else frames[i]
        for layer, k, v in dec.decode_frame(i, frame):
            if layers[layer] is not None:
                raise AssertionError(f"layer {layer} decoded twice")
            layers[layer] = (k, v)
    if any(lay is None for lay in layers):
        return None
    return KVCache(dec.header.layout, layers,  # type: ignore[arg-type]
                   int(dec.header.entry.start_position))


def _check_decoded(out: KVCache, case: reseal.Case, header: bytes, frames: list[bytes]) -> None:
    layout, shapes = reseal_seeds.declared_shapes(case.entry)
    if out.layout.fingerprint != layout.fingerprint or len(out.layers) != len(shapes):
        raise AssertionError("decoded a layout other than the header's")
    if out.start_position != case.entry.start_position:
        raise AssertionError("decoded another start position than the header's")
    for i, ((k, v), (ks, vs)) in enumerate(zip(out.layers, shapes)):
        if tuple(k.shape) != ks or tuple(v.shape) != vs:
            raise AssertionError(f"layer {i}: shapes {tuple(k.shape)}/{tuple(v.shape)}, "
                                 f"header declares {ks}/{vs}")
        if k.dtype != layout.dtype.torch or v.dtype != layout.dtype.torch:
            raise AssertionError(f"layer {i}: dtype {k.dtype}, header declares {layout.dtype}")
        mode = case.entry.codec.mode
        if mode in QUANTIZED:  # symbols times finite scales, clamped to the dtype: finite
            sink = KDN_LEVELS[case.entry.codec.level].sink_tokens if mode == "kdn" else 0
            for x in (k, v):
                if not torch.isfinite(x[:, sink:].float()).all():
                    raise AssertionError(f"layer {i}: {mode} decoded non-finite values")
    if reseal_seeds.signature(case.entry, frames) == case.seed.signature \
            and not reseal_seeds.same_tensors(out, case.seed.ref):
        raise AssertionError("decoded other tensors than the seed's, with nothing that "
                             "decides them changed")
    value = b"".join([header, *frames])
    fmt.parse_container(value, verify=True)  # what a server checks accepts what decodes
    copies.copy_checked(memoryview(bytearray(len(value))), value)


def _reseal(fdp: atheris.FuzzedDataProvider, seed: reseal_seeds.Seed) -> None:
    case = reseal.Case(seed)
    case.mutate(fdp, SEEDS[seed.partner] if seed.partner >= 0 else None)
    try:
        header, frames = case.seal()
    except KDNError:
        return
    try:
        out = _decode(fdp, header, frames)
    except KDNError:
        if b"".join([header, *frames]) == seed.blob:
            raise AssertionError(f"seed {seed.name} refused without a mutation") from None
        return
    if out is not None:
        _check_decoded(out, case, header, frames)


def _unsealed(fdp: atheris.FuzzedDataProvider, seed: reseal_seeds.Seed) -> None:
    blob = bytearray(seed.blob)
    for _ in range(fdp.ConsumeIntInRange(1, 4)):
        blob[fdp.ConsumeIntInRange(0, len(blob) - 1)] = fdp.ConsumeIntInRange(0, 255)
    if fdp.ConsumeBool():
        del blob[fdp.ConsumeIntInRange(0, len(blob)):]
    try:
        out = codec.decode(bytes(blob))
    except KDNError:
        return
    if not reseal_seeds.same_tensors(out, seed.ref):
        raise AssertionError("a container damaged under its checksums decoded to other tensors")


def _splice(fdp: atheris.FuzzedDataProvider, seed: reseal_seeds.Seed) -> None:
    """Frames of two entries of one layout, with their own (stale) sums: refused (version 2)."""
    if seed.partner < 0:
        return
    other = SEEDS[seed.partner]
    header = seed.blob[: fmt.header_size(seed.blob)]
    frames = [o if fdp.ConsumeBool() else s for s, o in zip(seed.frames, other.frames)]
    foreign = [i for i, f in enumerate(frames) if f != seed.frames[i]]
    if not foreign:
        return
    try:
        codec.decode(b"".join([header, *frames]))
    except KDNError:
        pass
    else:
        raise AssertionError(f"frames {foreign} of another entry decoded as part of {seed.name}")
    dec = StreamDecoder(header)
    i = fdp.PickValueInList(foreign)
    try:
        dec.decode_frame(i, frames[i])
    except KDNError:
        return
    raise AssertionError(f"frame {i} of another entry decoded by a streaming reader")


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    strategy = fdp.ConsumeIntInRange(0, 9)  # 0 (also what an empty input reads): reseal
    seed = SEEDS[fdp.ConsumeIntInRange(0, len(SEEDS) - 1)]
    if strategy <= 6:
        _reseal(fdp, seed)
    elif strategy == 7:
        _unsealed(fdp, seed)
    elif strategy == 8:
        _splice(fdp, seed)
    else:
        payload = fdp.ConsumeBytes(fdp.remaining_bytes())
        try:
            out = codec.decode(payload)
        except KDNError:
            return
        header = fmt.parse_header(payload)
        shapes = reseal_seeds.declared_shapes(header.entry)[1]
        if [(tuple(k.shape), tuple(v.shape)) for k, v in out.layers] != shapes:
            raise AssertionError("arbitrary bytes decoded to shapes their header does not declare")


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
