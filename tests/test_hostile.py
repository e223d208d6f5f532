"""Hostile input: random and mutated bytes into the container parser, the frame decoder and the
Store handler. Every input is answered with a typed kdn error (or a clean gRPC status), never a
crash, an untyped exception, an oversized allocation, or wrong tensors."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.codec import StreamDecoder, entropy
from kdn.codec import format as fmt
from kdn.codec.entropy import MAX_WIDTH, RANS_NIBBLE_MARK
from kdn.codec.format import (
    FRAME_SEED,
    build_frame,
    build_header,
    build_record,
    check_frame,
    parse_container,
    parse_header,
    seal,
)
from kdn.codec.layouts import layout_from_proto, layout_to_proto
from kdn.codec.modes import pack_sections, unpack_sections
from kdn.errors import Corrupt, InvalidArgument, InvalidLayout, KDNError
from kdn.layout import DType, KVLayout, LayerLayout
from kdn.options import Durability
from kdn.server import ServerThread
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import pruned_layout, random_kv, uniform_layout

KV = random_kv(pruned_layout(), 6, seed=5)
BLOB = {m: codec.encode(KV, m, layers_per_frame=2) for m in codec.mode_names()
        if m in ("raw", "lossless")}
SETTINGS = settings(max_examples=300, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def _decode_or_typed_error(blob: bytes) -> None:
    try:
        out = codec.decode(blob)
    except KDNError:
        return
    assert out.equal(KV), "a damaged container decoded to different tensors"


@SETTINGS
@given(st.binary(max_size=4096))
def test_random_bytes_never_crash_the_parser(data: bytes) -> None:
    for fn in (parse_header, parse_container, codec.decode):
        try:
            fn(data)  # type: ignore[operator]
        except KDNError:
            pass


@SETTINGS
@given(st.sampled_from(sorted(BLOB)), st.data())
def test_mutated_containers_are_rejected_or_exact(mode: str, data: st.DataObject) -> None:
    blob = bytearray(BLOB[mode])
    kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
    pos = data.draw(st.integers(0, len(blob) - 1))
    if kind == "flip":
        blob[pos] ^= 1 << data.draw(st.integers(0, 7))
    elif kind == "truncate":
        del blob[pos:]
    elif kind == "insert":
        blob[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
    else:
        chunk = data.draw(st.binary(min_size=1, max_size=16))
        blob[pos:pos + len(chunk)] = chunk
    _decode_or_typed_error(bytes(blob))


@SETTINGS
@given(tokens=st.integers(0, 2**40), heads=st.integers(0, 2**20),
       channels=st.integers(0, 2**20))
def test_lying_shape_fields_are_refused_before_allocation(tokens: int, heads: int,
                                                          channels: int) -> None:
    header = parse_header(codec.encode_parts(KV, "raw").header)
    entry = pb.EntryHeader()
    entry.CopyFrom(header.entry)
    entry.tokens = min(tokens, 2**64 - 1)
    entry.layout.layers[0].kv_heads = min(heads, 2**32 - 1)
    entry.layout.layers[0].k_channels = min(channels, 2**32 - 1)
    try:
        h = parse_header(build_header(entry))
    except KDNError:
        return
    # accepted: the declared layer must be within the decode limit, and frames must match it
    dec = StreamDecoder(h)
    for i, frame in enumerate(codec.encode_parts(KV, "raw", layers_per_frame=2).frames):
        try:
            dec.decode_frame(i, frame)
        except KDNError:
            pass


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    from kdn.server import ServerConfig

    cfg = ServerConfig(port=0, data_dir=tmp_path_factory.mktemp("hostile"), disk_bytes=0,
                       max_message_bytes=1 << 20)
    with ServerThread(cfg) as server:
        yield server


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.binary(max_size=2048), min_size=0, max_size=4))
def test_store_handler_survives_garbage_messages(hostile_server: ServerThread,
                                                 msgs: list[bytes]) -> None:
    """Raw bytes as StoreRequest messages (malformed protobufs included) get a status, and the
    server keeps serving what it stored before."""
    with grpc.insecure_channel(hostile_server.address) as ch:
        store = ch.stream_unary("/kdn.v1.KDN/Store", request_serializer=lambda b: b,
                                response_deserializer=pb.StoreResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            store(iter(msgs), timeout=10)
        assert info.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                     grpc.StatusCode.INTERNAL,
                                     grpc.StatusCode.RESOURCE_EXHAUSTED)
    with Client(hostile_server.address) as c:
        key = keys.chunk_key([1], KV.layout)
        if not c.contains(key):
            c.store(key, KV)
        back = c.retrieve(key)
        assert back is not None and back.equal(KV)


def test_lying_total_bytes_and_huge_declared_sizes(hostile_server: ServerThread) -> None:
    parts = codec.encode_parts(KV, "raw")
    with Client(hostile_server.address) as c:
        stub = c.rpc.stub
        hdr = pb.StoreHeader(key=b"k" * 32, container_header=parts.header, total_bytes=2**62)
        with pytest.raises(grpc.RpcError) as info:
            stub.Store(iter([pb.StoreRequest(header=hdr)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        entry = parse_header(parts.header).entry
        entry.tokens = 2**40
        hdr = pb.StoreHeader(key=b"k" * 32, container_header=build_header(entry))
        with pytest.raises(grpc.RpcError) as info:
            stub.Store(iter([pb.StoreRequest(header=hdr)]), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "layer limit" in (info.value.details() or "")


@pytest.mark.parametrize("target,runs", [("fuzz_container.py", 20000), ("fuzz_store.py", 6000)])
def test_atheris_fuzz_targets_run_clean(target: str, runs: int, tmp_path: Path) -> None:
    """A bounded run of each libFuzzer target (fuzz/) finds nothing: the container decoders
    behind resealed checksums, and the servicer's Store-stream validation."""
    import resource
    import subprocess
    import sys

    path = Path(__file__).resolve().parents[1] / "fuzz" / target
    # libFuzzer's RSS limit reads the peak RSS the kernel reports, which a child inherits from
    # this (test) process: allow the target 2 GiB on top of that
    inherited_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    out = subprocess.run([sys.executable, str(path), f"-runs={runs}", "-seed=1",
                          f"-rss_limit_mb={inherited_mb + 2048}",
                          f"-artifact_prefix={tmp_path}/"],
                         capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert f"Done {runs} runs" in out.stderr


# ------------------------------------------------------------------ what the fuzzers found


def _resealed(parts: codec.EncodedParts, bodies: dict[int, bytes]) -> bytes:
    """``parts`` (one layer per frame) with the bodies of some layers replaced, every
    checksum recomputed: the bytes reach the mode decoders."""
    header = parse_header(parts.header)
    frames = []
    for i, frame in enumerate(parts.frames):
        rec = check_frame(header, i, frame)[0]
        body = bodies.get(rec.layer, bytes(rec.body))
        frames.append(build_frame(FRAME_SEED, i, rec.layer, [
            build_record(header.layout.layers[rec.layer], header.tokens, body)]))
    h, sealed = seal(header.entry, frames)
    return b"".join([h, *sealed])


def _sections(body: memoryview, count: int) -> list[bytes]:
    return [bytes(s) for s in unpack_sections(body, count, "test")]


def test_an_empty_cache_is_refused_by_encode_and_decoded_where_one_comes() -> None:
    """0 tokens: ``tensor_view`` could not cast an empty tensor (TypeError from encode). A
    cache of no tokens is refused by ``encode`` as what it is (InvalidArgument); an entry of
    none, which an older kdn or a hostile writer may have stored, decodes in every mode."""
    from kdn.codec import api
    from kdn.errors import InvalidArgument

    empty = random_kv(pruned_layout(), 0)
    for mode in codec.mode_names():
        level = codec.get_mode(mode).levels[0]
        with pytest.raises(InvalidArgument, match="holds no tokens"):
            codec.encode(empty, mode, level)
        blob = api._encode_unchecked(empty, mode, level, 1, False).to_bytes()  # noqa: SLF001
        back = codec.decode(blob)
        assert [tuple(k.shape) for k, _ in back.layers] == \
            [tuple(k.shape) for k, _ in empty.layers]


def test_kdn_scale_symbols_beyond_float32_are_refused() -> None:
    """A resealed kdn body whose log-scale symbols stay within the old |q| <= 4000 bound but
    give steps float32 can not hold decoded to NaN (inf step x symbol 0); now Corrupt."""
    parts = codec.encode_parts(KV, "kdn", "default", layers_per_frame=1)
    rec = check_frame(parse_header(parts.header), 0, parts.frames[0])[0]
    secs = _sections(rec.body, 4)
    blob = secs[2]  # the log-RMS streams: u32 mark | u32 n | u32 codes | zstd(lo | width) |
    assert struct.unpack_from("<I", blob)[0] == RANS_NIBBLE_MARK  # codes | rANS
    n = struct.unpack_from("<I", blob, 4)[0]
    tables = bytearray(zstandard.ZstdDecompressor().decompress(blob[12 : 12 + n]))
    struct.pack_into("<h", tables, 0, 2048)  # K scale row: symbols from 2048 up (2**128 +)
    packed = zstandard.ZstdCompressor().compress(bytes(tables))
    secs[2] = blob[:4] + struct.pack("<I", len(packed)) + blob[8:12] + packed + blob[12 + n :]
    with pytest.raises(Corrupt, match="scale symbols out of range"):
        codec.decode(_resealed(parts, {0: pack_sections(secs)}))


def test_values_past_float16_scales_are_refused_and_non_finite_scales_too() -> None:
    """int8 and cachegen store float16 scales: bf16/f32 values beyond their reach made an
    infinite scale and decoded as NaN (the whole token for cachegen), then came back clipped
    (1e30 as 8.3e6): they are refused at encode, naming the layer, up to the largest value
    each codes within its error (``max_abs``). A resealed body carrying a scale no encoder
    writes is refused: infinite, or NaN (int8 decoded a NaN scale's row as NaN, cachegen its
    token with a step of 1 / c)."""
    layout = KVLayout("big", (LayerLayout(1, 4, 4),), dtype=DType.BFLOAT16, head_dim=4)
    k, v = torch.randn(1, 3, 4).bfloat16(), torch.randn(1, 3, 4).bfloat16()
    for mode, scale_sections in (("cachegen", (0, 1)), ("int8", (0, 2))):
        top = codec.get_mode(mode).max_abs
        k[0, 1, 2] = 2 * top
        with pytest.raises(InvalidArgument, match=f"layer 0: K holds a value of magnitude .* "
                                                  f"past the .* lossy mode '{mode}'"):
            codec.encode_parts(KVCache(layout, [(k, v)]), mode)
        k[0, 1, 2] = top / 2
        parts = codec.encode_parts(KVCache(layout, [(k, v)]), mode, layers_per_frame=1)
        out = codec.decode(parts.to_bytes())
        torch.testing.assert_close(out.layers[0][0][0, 1, 2].float(), k[0, 1, 2].float(),
                                   rtol=0.01, atol=0)
        rec = check_frame(parse_header(parts.header), 0, parts.frames[0])[0]
        secs = _sections(rec.body, 3 if mode == "cachegen" else 4)
        for s in scale_sections:
            for value in (float("nan"), float("inf"), -float("inf")):
                bad = list(secs)
                bad[s] = struct.pack("<e", value) + bad[s][2:]
                with pytest.raises(Corrupt, match=r"a scale is not finite \(inf or NaN\)"):
                    codec.decode(_resealed(parts, {0: pack_sections(bad)}))


def test_declared_tensors_beyond_the_entry_are_refused_before_allocating() -> None:
    """A 5 KB raw container (checksums right) declaring 303 layers of 1 GiB each made decode()
    allocate its 300 GiB arena up front: MemoryError, or a huge reservation. decode() now
    refuses it from the entry's size, and a streaming reader that can not know the size
    falls back to layer-by-layer copies, each body's size checked first."""
    parts = codec.encode_parts(KV, "raw")
    header = parse_header(parts.header)
    entry = pb.EntryHeader()
    entry.CopyFrom(header.entry)
    for _ in range(300):
        entry.layout.layers.add().CopyFrom(entry.layout.layers[0])
    entry.tokens = 1 << 23  # 2 heads x 32 channels x 2 bytes: 1 GiB a layer, under the limit
    layout = layout_from_proto(entry.layout)
    entry.layout_fingerprint = layout.fingerprint
    del entry.frames[:]
    entry.frames.add(first_layer=0, num_layers=layout.num_layers)
    frame = build_frame(FRAME_SEED, 0, 0, [build_record(lay, entry.tokens, b"\0" * 8)
                                            for lay in layout.layers])
    h, frames = seal(entry, [frame])
    with pytest.raises(Corrupt, match="bytes of raw tensors in an entry of"):
        codec.decode(b"".join([h, *frames]))
    dec = StreamDecoder(h)  # no MemoryError: its arena is given up where it can not be had
    with pytest.raises(Corrupt):
        dec.decode_frame(0, frames[0])


def _lying_zstd(data: bytes, declared: int) -> bytes:
    """A zstd frame of ``data`` whose header declares ``declared`` bytes of content."""
    z = zstandard.ZstdCompressor(write_content_size=True).compress(data)
    fhd = z[4]
    assert fhd & 3 == 0  # no dictionary id
    single = fhd >> 5 & 1
    head = 5 + (0 if single else 1) + {0: single, 1: 2, 2: 4, 3: 8}[fhd >> 6]
    return z[:4] + bytes([0b11100000]) + struct.pack("<Q", declared) + z[head:]


def test_zstd_frames_declaring_huge_sizes_are_refused_before_allocating() -> None:
    """python-zstandard allocates what a frame header declares, whatever max_output_size says:
    a resealed lossless body or entropy table declaring 2**45 bytes raised MemoryError (and one
    declaring 16 GiB reserved it). The declared size is now checked first."""
    parts = codec.encode_parts(KV, "lossless", layers_per_frame=1)
    body = bytes(check_frame(parse_header(parts.header), 0, parts.frames[0])[0].body)
    raw = zstandard.ZstdDecompressor().decompress(body)
    assert codec.decode(_resealed(parts, {0: _lying_zstd(raw, len(raw))})).equal(KV)
    for declared in (1 << 34, 1 << 45, 1 << 62):
        with pytest.raises(Corrupt, match="zstd frame declares"):
            codec.decode(_resealed(parts, {0: _lying_zstd(raw, declared)}))
    parts = codec.encode_parts(KV, "kdn", "default", layers_per_frame=1)
    secs = _sections(check_frame(parse_header(parts.header), 0, parts.frames[0])[0].body, 4)
    blob = secs[3]  # format 4: u32 mark | u32 n | u32 codes | zstd(lo | width) | ...
    n = struct.unpack_from("<I", blob, 4)[0]
    tables = zstandard.ZstdDecompressor().decompress(blob[12 : 12 + n])
    lying = _lying_zstd(tables, 1 << 45)
    secs[3] = blob[:4] + struct.pack("<I", len(lying)) + blob[8:12] + lying + blob[12 + n :]
    with pytest.raises(Corrupt, match="zstd frame declares"):
        codec.decode(_resealed(parts, {0: pack_sections(secs)}))
    # a frame that declares no size: no kdn encoder writes one, and a GPU's decoder, which
    # sizes its buffers from the declared sizes, refuses it: so does the CPU (one answer)
    unsized = zstandard.ZstdCompressor(write_content_size=False).compress(tables)
    secs[3] = blob[:4] + struct.pack("<I", len(unsized)) + blob[8:12] + unsized + blob[12 + n :]
    with pytest.raises(Corrupt, match="zstd frame declares no size"):
        codec.decode(_resealed(parts, {0: pack_sections(secs)}))



@pytest.mark.parametrize("fmt", [2, 3])
def test_tables_lying_about_their_size_are_refused_before_staging(
        fmt: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Format-2/3 symbol tables whose zstd frames declare each blob's most (streams x
    (4 + MAX_WIDTH)) while their blocks hold a few KB: the whole-entry (GPU) planner staged
    what they all declared (268 MB here; 2 GiB for 32 such layers, a 440 KB entry) before
    decompressing any. The frames' block headers now bound what they may declare: both
    decoders refuse them, the planner before it stages anything."""
    pytest.importorskip("triton")
    from kdn.codec import gpu_batch, gpu_source

    with entropy.writing_format(fmt):
        parts = codec.encode_parts(random_kv(uniform_layout(4, 8, 128), 3, seed=fmt), "kdn",
                                   "default", layers_per_frame=1)
    header = parse_header(parts.header)
    bodies = {}
    for i, frame in enumerate(parts.frames):
        rec = check_frame(header, i, frame)[0]
        secs = _sections(rec.body, 4)
        sym = secs[3]  # u32 mark | u32 n | zstd(lo | width | counts) | rANS
        n = struct.unpack_from("<I", sym, 4)[0]
        lying = _lying_zstd(zstandard.ZstdDecompressor().decompress(sym[8 : 8 + n]),
                            8 * (128 + 128) * (4 + MAX_WIDTH))
        secs[3] = sym[:4] + struct.pack("<I", len(lying)) + lying + sym[8 + n :]
        bodies[rec.layer] = pack_sections(secs)
    staged: list[int] = []
    arrays = gpu_source.Staging.arrays

    def measured(self: Any) -> Any:
        staged.append(self.total)
        assert self.total < 64 << 20, f"the planner stages {self.total} bytes"  # not allocated
        return arrays(self)

    monkeypatch.setattr(gpu_source.Staging, "arrays", measured)
    monkeypatch.setattr(gpu_batch, "_launch", lambda *a, **k: None)  # the host's share only
    codec.decode(parts.to_bytes(), batched=True)  # what the honest entry stages
    honest, staged[:] = max(staged), []
    blob = _resealed(parts, bodies)
    with pytest.raises(Corrupt, match="layer 0: zstd frame declares no or too large a size"):
        codec.decode(blob, batched=True)
    with pytest.raises(Corrupt, match="zstd frame declares 67117056 bytes, at most"):
        codec.decode(blob)
    assert staged == [] and honest < 1 << 20

def _servicer() -> tuple[Any, Any, Any]:
    """A servicer with a RAM tier only and a tenant with a quota, called without a network."""
    from kdn.server import ServerConfig
    from kdn.server.app import build_store
    from kdn.server.auth import AuthConfig, Authenticator, TenantPolicy
    from kdn.server.service import KDNServicer

    cfg = ServerConfig(port=0, data_dir=Path("unused"), disk_bytes=0)
    auth = Authenticator(AuthConfig(policies={"t": TenantPolicy(quota_bytes=1 << 20)}))
    store = build_store(cfg)
    return KDNServicer(cfg, store, auth), store, auth


class _Context:
    """The status a handler ends its call with (``kdn.server.rpc.end_call``)."""

    code: grpc.StatusCode | None = None
    details = ""

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


def test_a_durability_the_server_can_not_give_is_refused_before_charging() -> None:
    """A durability outside the enum failed in ``Durability(...)`` after the tenant was charged
    (ValueError: UNKNOWN, on Store and on PutMany after earlier items were stored); one the
    server has no tier for (SHARED without Redis, DISK without a disk) failed in the put, also
    after the charge: a quota that leaked. Both are now refused with the header."""
    import asyncio

    from kdn.server.auth import Principal, Role, current_principal

    servicer, store, auth = _servicer()
    parts = codec.encode_parts(KV, "raw")
    key = keys.chunk_key([1], KV.layout)
    token = current_principal.set(Principal("t", Role.TENANT))
    try:
        async def messages(durability: int) -> Any:
            yield pb.StoreRequest(header=pb.StoreHeader(
                key=key, container_header=parts.header,
                options=pb.StoreOptions(durability=durability)))  # type: ignore[arg-type]
            for i, f in enumerate(parts.frames):
                yield pb.StoreRequest(frame=pb.Frame(index=i, data=f))

        for durability in (7, 2**31 - 1, int(Durability.SHARED), int(Durability.DISK)):
            ctx = _Context()
            asyncio.run(servicer.Store(messages(durability), ctx))
            assert ctx.code == grpc.StatusCode.INVALID_ARGUMENT
            assert "durability" in ctx.details
            with pytest.raises(KDNError, match="durability"):
                servicer.puts.put(Principal("t", Role.TENANT), pb.PutManyRequest(items=[
                    pb.PutItem(key=key, data=parts.to_bytes()),
                    pb.PutItem(key=keys.chunk_key([2], KV.layout), data=parts.to_bytes(),
                               options=pb.StoreOptions(durability=durability)),  # type: ignore[arg-type]
                ]))
            assert auth.usage("t") == 0 and not store.keys(b"")
    finally:
        current_principal.reset(token)
        store.close()


def test_shapes_the_frame_fields_can_not_hold_are_refused(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """A header declaring 70,000 K channels (a record's field is 16-bit) passed parse_header,
    and the in-place paths (copy_entry, staging_span) then raised struct.error building the
    records they expect. The header is refused now, and a prefix that can not be packed is
    InvalidLayout wherever it is built."""
    parts = codec.encode_parts(KV, "raw")
    entry = pb.EntryHeader()
    entry.CopyFrom(parse_header(parts.header).entry)
    entry.layout.layers[0].k_channels = 70_000
    entry.layout_fingerprint = layout_from_proto(entry.layout).fingerprint
    h, frames = seal(entry, list(parts.frames))
    monkeypatch.setattr(fmt, "_HEADERS", type(fmt._HEADERS)(16))  # as another process meets it
    blob = b"".join([h, *frames])
    with pytest.raises(InvalidLayout, match="16-bit"):
        codec.decode(blob)
    with pytest.raises(InvalidLayout, match="16-bit"):
        StreamDecoder(h).copy_entry(blob)
    lay = layout_from_proto(entry.layout).layers[0]
    with pytest.raises(InvalidLayout, match="does not fit"):
        fmt.record_prefix(lay, 1, 10)
    with pytest.raises(InvalidLayout, match="does not fit"):
        fmt.frame_prefix(0, 0, 1, 1 << 32, 0)


def test_positions_past_int64_are_refused_by_every_reader(hostile_server: ServerThread,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A container declaring start_position 2**64 - 1 was refused by codec.decode (its
    KVCache) but stored by the server and handed out by Client.retrieve, whose fast path
    builds the cache unvalidated. The header is refused now, so the server refuses it on
    store; a start whose last token passes 2**63 - 1 too, and a KVCache so placed."""
    parts = codec.encode_parts(KV, "raw")
    tokens = KV.num_tokens
    monkeypatch.setattr(fmt, "_HEADERS", type(fmt._HEADERS)(16))
    for start in (2**64 - 1, 2**63, 2**63 - tokens + 1):
        entry = pb.EntryHeader()
        entry.CopyFrom(parse_header(parts.header).entry)
        entry.start_position = start
        h, frames = seal(entry, list(parts.frames))
        with pytest.raises(InvalidLayout, match="positions must stay within"):
            codec.decode(b"".join([h, *frames]))
        with Client(hostile_server.address) as c:
            key = keys.chunk_key([9, start % 1000], KV.layout)
            with pytest.raises(InvalidArgument, match="positions must stay within"):
                c.store(key, codec.EncodedParts(h, frames))
            assert not c.contains(key)
    entry = pb.EntryHeader()
    entry.CopyFrom(parse_header(parts.header).entry)
    entry.start_position = 2**63 - tokens  # its last token at 2**63 - 1: kept
    h, frames = seal(entry, list(parts.frames))
    assert codec.decode(b"".join([h, *frames])).start_position == 2**63 - tokens
    with pytest.raises(InvalidLayout, match="last past the largest position"):
        KVCache(KV.layout, KV.layers, 2**63 - tokens + 1)


@pytest.mark.parametrize("mode,level", [("kdn", "default"), ("int8", "")])
def test_the_whole_entry_decode_checks_bodies_before_allocating(
        mode: str, level: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 3 KB entry whose header declares 40 layers of 4 GiB (each under the layer limit)
    and whose bodies are 16 empty bytes: the whole-entry (GPU) decode allocated its 160 GiB
    output before reading a body (an allocator's error, not Corrupt). The bodies are checked
    first, as the CPU path checks them. (A host short of 160 GiB refuses the entry as
    TooLarge before either, ``test_decode_bombs``: here the host is taken to have room.)"""
    from kdn.codec import room

    pytest.importorskip("triton")
    monkeypatch.setattr(room, "host_room", lambda: 1 << 50)
    layout = KVLayout("m", tuple(LayerLayout(8, 128, 128) for _ in range(40)), head_dim=128)
    tokens = 1 << 20  # 8 heads x 256 channels x 2 bytes x 2**20 = 4 GiB a layer
    frames = [build_frame(FRAME_SEED, i, i, [build_record(lay, tokens, b"\0" * 16)])
              for i, lay in enumerate(layout.layers)]
    entry = pb.EntryHeader(layout=layout_to_proto(layout),
                           codec=pb.Codec(mode=mode, level=level), tokens=tokens,
                           frames=[pb.FrameSpan(first_layer=i, num_layers=1)
                                   for i in range(40)],
                           layout_fingerprint=layout.fingerprint)
    h, sealed = seal(entry, frames)
    for batched in (False, True):
        with pytest.raises(Corrupt):
            codec.decode(b"".join([h, *sealed]), batched=batched)


def test_a_server_declaring_a_huge_entry_gets_nothing_set_aside(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A Retrieve answer's header declares the entry's total bytes before any frame: a size
    past any entry is Corrupt before the client sets memory aside, and one it can not have is
    TooLarge (kdn's error tree), never numpy's MemoryError."""
    from kdn.client import received
    from kdn.errors import TooLarge

    parts = codec.encode_parts(KV, "lossless")
    for total in (1 << 45, 1 << 62):
        head = pb.RetrieveHeader(container_header=parts.header, total_bytes=total)
        with pytest.raises(Corrupt, match=f"declared an entry of {total} bytes"):
            received.received(head, iter(()))

    class NoRoom:
        def take(self, n: int) -> object:
            raise MemoryError(f"Unable to allocate {n} bytes")

    monkeypatch.setattr(received, "RECEIVED", NoRoom())
    head = pb.RetrieveHeader(container_header=parts.header, total_bytes=1 << 35)
    with pytest.raises(TooLarge, match="no memory for an entry of"):
        received.received(head, iter(()))
