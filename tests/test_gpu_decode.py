"""The GPU decoder (kdn.codec.gpu, Triton) reads the same bytes as the CPU decoder and gives the
same symbols: checked here through Triton's interpreter (exact, slow: small blocks), and on a
CUDA device with real SmolLM2 KV where one is present."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import functools, os, struct
    import numpy as np, torch, zstandard
    from kdn.codec import gpu, quant, rans
    from kdn.codec.entropy import RANS_MARK, _tables, decode_streams
    from kdn.errors import Corrupt

    def blob(sym, block):
        lo, w, c = _tables(sym)
        t = lo.astype("<i2").tobytes() + w.astype("<u2").tobytes() + c.tobytes()
        packed = zstandard.ZstdCompressor(level=9).compress(t)
        return (struct.pack("<II", RANS_MARK, len(packed)) + packed
                + rans.encode(sym, lo, w, c, block=block))

    rng = np.random.default_rng(0)
    checked = 0
    for rows, n, block, spread in ((1, 1, 4, 1.0), (5, 13, 4, 0.4), (12, 37, 8, 1.5),
                                   (40, 70, 16, 3.0), (9, 33, 33, 60.0)):
        sym = np.clip(np.round(rng.normal(0, spread, (rows, n))), -3000, 3000).astype(np.int32)
        sym[0] = 5  # a constant row
        b = blob(sym, block)
        cpu = decode_streams(b, rows, n)
        for pack in (False, True):  # packed: the one staging buffer a GPU gets
            gpu.upload_many = functools.partial(quant.upload_many, pack=pack)
            dev = gpu.decode_on(b, rows, n, torch.device("cpu")).numpy()
            assert (cpu == sym).all() and (dev == cpu).all(), (rows, n, block, pack)
        checked += 1
    sym = rng.integers(-3, 4, (4, 40)).astype(np.int32)
    sym[0, 10], sym[1, 0] = 600, -20000  # bins that never occur: a bucket spans many of them
    sym[2:] = rng.permutation(np.arange(-15000, 15000, 750))  # a gap of 749 bins at each
    b = blob(sym, 8)
    assert (decode_streams(b, 4, 40) == sym).all()
    assert (gpu.decode_on(b, 4, 40, torch.device("cpu")).numpy() == sym).all()
    checked += 1
    sym = np.clip(np.round(rng.normal(0, 1.5, (12, 40))), -9, 9).astype(np.int32)
    good = bytearray(blob(sym, 8))
    refused = 0
    for cut in (2, 6, 40):
        try:
            gpu.decode_on(bytes(good[:-cut]), 12, 40, torch.device("cpu"))
        except Corrupt:
            refused += 1
    bad = bytearray(good)
    bad[-10:] = bytes(10)  # zeroed words: the end states can not come out right
    try:
        gpu.decode_on(bytes(bad), 12, 40, torch.device("cpu"))
    except Corrupt:
        refused += 1
    print("ok", checked, refused)
''')


def test_the_triton_kernel_matches_the_cpu_decoder_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                         text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-3:] == ["ok", "6", "4"], run.stdout


def real_kv_entries() -> dict[str, bytes]:
    """Entries of real SmolLM2-135M KV (2048 tokens of English, fp16) in each GPU-decodable
    mode. ``$KDN_REAL_KV``: a folder of such entries written by ``python -m
    tests.test_gpu_decode DIR`` on a host with the packaged model (a GPU host without it reads
    them there: the model's weights do not travel, its KV's encoded bytes do)."""
    folder = os.environ.get("KDN_REAL_KV")
    if folder:
        return {p.stem: p.read_bytes() for p in sorted(Path(folder).glob("*.kdn"))}
    return encode_real_kv(2048)


def encode_real_kv(tokens: int) -> dict[str, bytes]:
    from kdn import codec
    from kdn.codec import entropy
    from kdn.layout import KVLayout
    from kdn.model.data import english_token_ids
    from kdn.model.hf import prefill
    from kdn.model.models import load_model

    model, tok = load_model("smollm2-135m")
    layout = KVLayout.from_config(model.config, dtype=torch.float16)
    kv = prefill(model, english_token_ids(tokens, tok), layout)[0]
    out = {f"{mode}{level}": codec.encode_parts(kv, mode, level).to_bytes()
           for mode, level in (("kdn", "default"), ("cachegen", ""), ("int8", ""))}
    with entropy.writing_format(3):  # what kdn wrote before format 4: still decoded alike
        out["kdndefault-format3"] = codec.encode_parts(kv, "kdn", "default").to_bytes()
    return out


@pytest.mark.gpu
@pytest.mark.model
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_and_cpu_decode_real_kv_bit_identically() -> None:
    pytest.importorskip("triton")
    from kdn import codec

    entries = real_kv_entries()
    assert sorted(entries) == ["cachegen", "int8", "kdndefault", "kdndefault-format3"], \
        sorted(entries)
    for name, blob in entries.items():
        cpu = codec.decode(blob)
        dev = codec.decode(blob, device="cuda")
        assert cpu.num_tokens >= 1024, name  # a real context, not a toy
        for (kc, vc), (kg, vg) in zip(cpu.layers, dev.layers, strict=True):
            assert kg.is_cuda and vg.is_cuda, name
            assert torch.equal(kc, kg.cpu()) and torch.equal(vc, vg.cpu()), name


if __name__ == "__main__":  # write the real-KV entries for a GPU host without the model
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for name, blob in encode_real_kv(int(sys.argv[2]) if len(sys.argv) > 2 else 2048).items():
        (out / f"{name}.kdn").write_bytes(blob)
        print(name, len(blob))
