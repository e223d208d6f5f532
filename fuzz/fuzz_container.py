"""atheris fuzz target: container parsing, frame checks and decoding of arbitrary bytes.

    python fuzz/fuzz_container.py -runs=100000        # or -max_total_time=600

Seeds with real containers (raw and lossless, a pruned layout) so mutations reach the frame
and mode decoders. Any exception that is not a kdn error is a finding; a decode that succeeds
must give back exactly the seed's tensors.
"""

from __future__ import annotations

import sys

import atheris
import torch  # not instrumented: coverage is wanted in kdn's own code

with atheris.instrument_imports():
    from kdn import codec
    from kdn.cache import KVCache
    from kdn.errors import KDNError
    from kdn.layout import KVLayout, LayerLayout

LAYOUT = KVLayout("fuzz", (LayerLayout(2, 8, 4, tuple(range(0, 16, 2)), None),
                           LayerLayout(1, 3, 6)), head_dim=16)
_G = torch.Generator().manual_seed(0)
KV = KVCache(LAYOUT, [(torch.randn(lay.kv_heads, 5, lay.k_channels, generator=_G).half(),
                       torch.randn(lay.kv_heads, 5, lay.v_channels, generator=_G).half())
                      for lay in LAYOUT.layers])
SEEDS = [codec.encode(KV, mode) for mode in ("raw", "lossless")]


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    choice = fdp.ConsumeIntInRange(0, 2)
    if choice < 2:  # mutate a real container at a few places
        blob = bytearray(SEEDS[choice])
        for _ in range(fdp.ConsumeIntInRange(1, 4)):
            pos = fdp.ConsumeIntInRange(0, len(blob) - 1)
            blob[pos] = fdp.ConsumeIntInRange(0, 255)
        if fdp.ConsumeBool():
            del blob[fdp.ConsumeIntInRange(0, len(blob)):]
        payload = bytes(blob)
    else:
        payload = fdp.ConsumeBytes(fdp.remaining_bytes())
    try:
        out = codec.decode(payload)
    except KDNError:
        return
    if not out.equal(KV):
        raise AssertionError("damaged container decoded to different tensors")


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
