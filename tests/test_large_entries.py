"""Entries sized for real models (issue 18 item 2): the limits an 8B model's long context
needs, with the size cap kept as a guard; big Stores land in one buffer of the declared size;
frames that can not travel are refused before anything is sent; the engine's block size
follows the model."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.engine.config import CHUNK_TOKENS, MAX_CHUNK_BYTES, default_chunk_tokens
from kdn.errors import TooLarge
from kdn.layout import DType, KVLayout, LayerLayout
from kdn.server import ServerConfig, ServerThread
from kdn.transport.buffers import MIN_BYTES as _BUFFER_FROM
from kdn.transport.wire import frame_message
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import random_kv


def _layout(layers: int, heads: int, dim: int, dtype: DType = DType.FLOAT16) -> KVLayout:
    return KVLayout("big-model", tuple(LayerLayout(heads, dim, dim) for _ in range(layers)),
                    dtype=dtype, head_dim=dim)


def _kv(layout: KVLayout, tokens: int) -> KVCache:
    return random_kv(layout, tokens, seed=tokens)


def test_defaults_hold_an_8b_models_long_context() -> None:
    cfg = ServerConfig()
    llama8b = _layout(32, 8, 128)
    assert llama8b.bytes_per_token == 128 << 10
    assert cfg.max_entry_bytes >= 32768 * llama8b.bytes_per_token  # 4 GiB: 32k tokens
    layer_of_32k = 32768 * llama8b.bytes_per_token // 32  # 128 MiB: one frame, one message
    assert cfg.max_message_bytes > layer_of_32k + 1024


@pytest.mark.parametrize("shape, tokens", [
    ((30, 3, 64, DType.FLOAT32), 256),   # SmolLM2-135M fp32: 11 MiB per block
    ((32, 8, 128, DType.FLOAT16), 256),  # Llama-3-8B fp16: 32 MiB
    ((80, 8, 128, DType.FLOAT16), 128),  # Llama-3-70B fp16: 80 MiB at 256 -> 40 MiB at 128
    ((200, 32, 128, DType.FLOAT32), 16),  # beyond: halved down to the floor
])
def test_block_size_follows_the_model(shape: tuple[int, int, int, DType], tokens: int) -> None:
    layout = _layout(*shape)
    assert default_chunk_tokens(layout) == tokens
    assert tokens == CHUNK_TOKENS or tokens == 16 or \
        tokens * layout.bytes_per_token <= MAX_CHUNK_BYTES < 2 * tokens * layout.bytes_per_token


def test_a_pruned_layout_gets_its_own_block_size() -> None:
    pruned = KVLayout("pruned", tuple(LayerLayout(8, 128 - i, 64 + i % 64)
                                      for i in range(80)), dtype=DType.FLOAT32, head_dim=128)
    want = CHUNK_TOKENS
    while want * pruned.bytes_per_token > MAX_CHUNK_BYTES:
        want //= 2
    assert default_chunk_tokens(pruned) == want < CHUNK_TOKENS


def test_an_entry_bigger_than_the_buffer_threshold_round_trips(tmp_path: Path) -> None:
    layout = _layout(4, 4, 128)
    tokens = _BUFFER_FROM // layout.bytes_per_token + 64  # past the one-buffer threshold
    kv = _kv(layout, tokens)
    key = keys.chunk_key([7], layout)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", ram_bytes=1 << 30, disk_bytes=1 << 30)
    with ServerThread(cfg) as server, Client(server.address, shm_bytes=0, data_path=False) as c:
        resp = c.store(key, kv, mode="raw")  # over gRPC: the Store stream
        assert resp.stored_bytes > _BUFFER_FROM
        got = c.retrieve(key, layout=layout)
        assert got is not None and got.equal(kv)
        assert server.server is not None
        disk = next(t for t in server.server.store.tiers if t.name == "disk")
        assert server.server.store.flush(timeout=30)
        value = disk.get(keys.store_key("", "default", key))
        assert value is not None and len(value) == resp.stored_bytes


def _stream(parts: codec.EncodedParts, key: bytes, total: int) -> list[object]:
    msgs: list[object] = [pb.StoreRequest(header=pb.StoreHeader(
        key=key, container_header=parts.header, total_bytes=total))]
    msgs += [pb.StoreRequest.FromString(frame_message(i, f)) for i, f in enumerate(parts.frames)]
    return msgs


def test_a_declared_size_that_lies_is_refused_and_nothing_is_stored(tmp_path: Path) -> None:
    layout = _layout(2, 4, 128)
    kv = _kv(layout, 512)
    parts = codec.encode_parts(kv, "raw")
    key = keys.chunk_key([8], layout)
    cfg = ServerConfig(port=0, data_dir=tmp_path / "d", max_entry_bytes=256 << 20)
    with ServerThread(cfg) as server, grpc.insecure_channel(server.address) as ch:
        stub = pb_grpc.KDNStub(ch)
        for declared, words in ((max(_BUFFER_FROM, parts.nbytes) + 1, "frames hold"),  # > sent
                                (512 << 20, "exceeds max_entry_bytes")):  # over the guard
            with pytest.raises(grpc.RpcError) as info:
                stub.Store(iter(_stream(parts, key, declared)), timeout=30)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT or \
                info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert words in (info.value.details() or "")
        assert not stub.Lookup(pb.LookupRequest(keys=[key])).infos[0].present
        stub.Store(iter(_stream(parts, key, parts.nbytes)), timeout=30)  # the truth: stored
        assert stub.Lookup(pb.LookupRequest(keys=[key])).infos[0].present


def test_a_frame_too_big_for_one_message_is_refused_before_sending(tmp_path: Path) -> None:
    layout = _layout(2, 4, 128)
    kv = _kv(layout, 2048)  # 4 MiB per layer
    key = keys.chunk_key([9], layout)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as server:
        with Client(server.address, shm_bytes=0, data_path=False, max_message_bytes=1 << 20) as c:
            with pytest.raises(TooLarge, match="store fewer tokens per entry"):
                c.store(key, kv, mode="raw", layers_per_frame=1)
            assert not c.lookup([key]).infos[0].present


@pytest.mark.parametrize("copied", [False, True], ids=["framed", "copied"])
@pytest.mark.parametrize("tokens", [2048, 8320], ids=["inline", "background"])
@pytest.mark.parametrize("damage", ["flipped", "shapes", "short"])
def test_large_frames_checked_as_they_land_refuse_damage_and_keep_the_old_value(
        tmp_path: Path, damage: str, tokens: int, copied: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Store frames are checked the moment they are whole: on the event loop's thread (2 MiB
    frames), or from ``BACKGROUND_CHECK_BYTES`` on other threads while the next arrives; kept
    as frames, or (past ``framed_limit``: ``MAX_FRAMED_BYTES`` lowered) copied into one buffer
    as they are checked. A bit flipped in a middle frame, a frame whose record declares other shapes
    behind a checksum sealed for it, or a frame cut short is refused (INVALID_ARGUMENT), the
    value stored before under the key stays, and the intact stream then stores exactly the
    entry."""
    from kdn.codec.format import build_header, build_record, frame_with_sum, parse_header
    from kdn.server import receive
    from kdn.store import framed

    if copied:
        monkeypatch.setattr(framed, "MAX_FRAMED_BYTES", 1 << 20)

    layout = _layout(4, 4, 64)
    kv = _kv(layout, tokens)
    parts = codec.encode_parts(kv, "raw", layers_per_frame=1)
    assert (min(map(len, parts.frames)) >= receive.BACKGROUND_CHECK_BYTES) == (tokens > 4096)
    old = _kv(layout, 64)
    key = keys.chunk_key([11], layout)
    header = parse_header(parts.header)
    frames = [bytes(f) for f in parts.frames]
    head = bytes(parts.header)
    if damage == "flipped":
        bad = bytearray(frames[2])
        bad[len(bad) // 2] ^= 0x01
        frames[2], words = bytes(bad), "frame 2"
    elif damage == "shapes":  # as many bytes, other channels: only the records can tell
        lay = layout.layers[2]
        wrong = LayerLayout(lay.kv_heads, lay.k_channels + 32, lay.v_channels - 32)
        body = b"\0" * (lay.kv_heads * tokens * (lay.k_channels + lay.v_channels) * 2)
        frames[2], full = frame_with_sum(header.frame_seed, 2, 2,
                                         [build_record(wrong, tokens, body)])
        assert len(frames[2]) == len(parts.frames[2])
        entry = pb.EntryHeader()
        entry.CopyFrom(header.entry)
        entry.frames[2].checksum = full
        head, words = build_header(entry), "layer 2"
    else:
        frames[1], words = frames[1][:-7], "frame 1"
    total = len(head) + sum(map(len, frames))
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as server, \
            Client(server.address, shm_bytes=0, data_path=False) as c, \
            grpc.insecure_channel(server.address, options=[
                ("grpc.max_send_message_length", 64 << 20)]) as ch:
        c.store(key, old, mode="raw")
        stub = pb_grpc.KDNStub(ch)
        msgs: list[object] = [pb.StoreRequest(header=pb.StoreHeader(
            key=key, container_header=head, total_bytes=total))]
        msgs += [pb.StoreRequest.FromString(frame_message(i, f)) for i, f in enumerate(frames)]
        with pytest.raises(grpc.RpcError) as info:
            stub.Store(iter(msgs), timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, info.value.details()
        assert words in (info.value.details() or "")
        back = c.retrieve(key, layout=layout)
        assert back is not None and back.equal(old)
        stub.Store(iter(_stream(parts, key, parts.nbytes)), timeout=30)
        back = c.retrieve(key, layout=layout)
        assert back is not None and back.equal(kv)
