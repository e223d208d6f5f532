"""Entries that decode to far more than they store: a compressed mode is no bound on its
decoded size (a constant cache costs its tables alone), so a few kilobytes under a resealed
header may declare a million tokens. Decoding to the host, such an entry is refused as
TooLarge before anything is allocated, where the host could not hold it; the store, the
server and the reader's other entries are untouched."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client
from kdn.codec import format as fmt
from kdn.codec import room
from kdn.errors import TooLarge
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout

GOOD, BOMB = bytes(range(32)), bytes(range(1, 33))
_RECORD = struct.Struct("<HIHHI")  # kv_heads, tokens, k_channels, v_channels, body length


def declaring(kv: KVCache, tokens: int, mode: str = "kdn", level: str = "default"
              ) -> codec.EncodedParts:
    """``kv`` encoded, then its header and every layer record rewritten to declare ``tokens``
    tokens, every checksum recomputed (what a writer that lies would store). Its bodies stay
    valid for constant layers: their entropy rows cost no payload at any length."""
    blob = codec.encode(kv, mode, level)
    entry = fmt.parse_header(blob).entry
    entry.tokens = tokens
    frames, at = [], fmt.header_size(blob)
    for _ in entry.frames:
        length = fmt.FRAME_STRUCT.unpack_from(blob, at)[4]
        frame = bytearray(blob[at : at + fmt.FRAME_PREFIX_BYTES + length])
        at += fmt.FRAME_PREFIX_BYTES + length
        rec = fmt.FRAME_PREFIX_BYTES
        while rec < len(frame):
            fields = list(_RECORD.unpack_from(frame, rec))
            fields[1] = tokens
            _RECORD.pack_into(frame, rec, *fields)
            rec += _RECORD.size + fields[4]
        frames.append(bytes(frame))
    header, sealed = fmt.seal(entry, frames)
    return codec.EncodedParts(header, sealed)


def _constant(layers: int = 32, heads: int = 8, dim: int = 64, tokens: int = 64) -> KVCache:
    layout = uniform_layout(layers, heads, dim, model="bomb")
    z = torch.zeros(heads, tokens, dim, dtype=torch.float16)
    return KVCache(layout, [(z, z) for _ in range(layers)], 0)


def test_a_small_entry_declaring_more_than_the_host_holds_is_refused_before_decoding(
        monkeypatch: pytest.MonkeyPatch) -> None:
    parts = declaring(_constant(), 8192)  # 0.5 GiB decoded, ~90 KB stored
    declared = 32 * 8 * 8192 * 64 * 2 * 2
    assert parts.nbytes < declared / 1000
    monkeypatch.setattr(room, "host_room", lambda: declared // 4)
    with pytest.raises(TooLarge, match=r"decodes to 0\.5 GiB \(8192 tokens\)"):
        codec.decode(parts.to_bytes())
    with pytest.raises(TooLarge):
        codec.StreamDecoder(parts.header)
    monkeypatch.setattr(room, "host_room", lambda: declared * 4)
    small = declaring(_constant(tokens=16), 512)  # within room: decodes as declared
    assert codec.decode(small.to_bytes()).equal(_constant(tokens=512))


def test_an_entry_declaring_a_terabyte_is_refused_on_any_host(tmp_path: Path) -> None:
    """256 layers at the per-layer limit: 1 TiB declared, which no host has available. Run in
    a child with its address space capped, so that a decoder without the check fails there
    (MemoryError) instead of having the kernel kill the test run."""
    parts = declaring(_constant(layers=256, heads=1, dim=4, tokens=16), (4 << 30) // 16)
    path = tmp_path / "bomb.kdn"
    path.write_bytes(parts.to_bytes())
    child = textwrap.dedent(f"""
        import resource, sys
        from kdn import codec
        from kdn.errors import TooLarge
        with open("/proc/self/status") as f:
            vm = next(int(x.split()[1]) * 1024 for x in f if x.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (3 << 30), resource.RLIM_INFINITY))
        try:
            codec.decode(open({str(path)!r}, "rb").read())
        except TooLarge as exc:
            print("TooLarge", exc)
        except MemoryError:
            print("MemoryError")
        """)
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.startswith("TooLarge the entry decodes to 1024.0 GiB"), \
        (out.stdout, out.stderr[-2000:])


@pytest.mark.parametrize("shm_bytes", [0, 64 << 20], ids=["grpc", "same-host"])
def test_a_reader_is_refused_a_stored_bomb_and_keeps_its_other_entries(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shm_bytes: int) -> None:
    """A real server stores the lying entry (its structure is sound); a client retrieving it
    gets TooLarge, not a decode that takes the host down; its other entries, the bomb's own
    bytes and the server are as they were. An engine asking for the block's token count is
    refused earlier, by the shape (``Expected``)."""
    from kdn.errors import LayoutMismatch

    kv = random_kv(uniform_layout(32, 8, 64, model="bomb"), tokens=32)
    parts = declaring(_constant(), 8192)
    monkeypatch.setattr(room, "host_room", lambda: 256 << 20)
    with ServerThread(ServerConfig(port=0, data_dir=tmp_path / "d")) as server, \
            Client(server.address, shm_bytes=shm_bytes) as client:
        client.store(GOOD, kv, mode="kdn", level="default")
        client.store(BOMB, parts)
        with pytest.raises(TooLarge, match="decodes to 0.5 GiB"):
            client.retrieve(BOMB)
        with pytest.raises(LayoutMismatch, match="8192 tokens"):
            client.retrieve(BOMB, tokens=64)
        fetched = client.fetch(BOMB)
        assert fetched is not None and fetched.parts.to_bytes() == parts.to_bytes()
        got = client.retrieve(GOOD)
        assert got is not None and got.num_tokens == 32
        assert client.health() == "SERVING"


@pytest.mark.parametrize("limit", ["4294967296", "max"])
def test_a_containers_memory_limit_bounds_the_room(tmp_path: Path, limit: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """In a memory cgroup (a container, a pod), the room is its limit less its use, with page
    cache counted as free; a cgroup without a limit ("max") leaves the host's MemAvailable."""
    (tmp_path / "memory.max").write_text(limit + "\n")
    (tmp_path / "memory.current").write_text(str(3 << 30) + "\n")
    (tmp_path / "memory.stat").write_text(f"anon {2 << 30}\nfile {512 << 20}\nkernel 1024\n")
    monkeypatch.setattr(room, "_CGROUPS", ((str(tmp_path / "memory.max"),
                                            str(tmp_path / "memory.current"),
                                            str(tmp_path / "memory.stat"), "file"),))
    monkeypatch.setattr(room, "_meminfo", lambda: 64 << 30)
    assert room.host_room() == ((3 << 29) if limit != "max" else 64 << 30)
    if limit != "max":
        with pytest.raises(TooLarge, match="decodes to 2.0 GiB .* 1.5 GiB of memory available"):
            room.check_room(2 << 30, 65536)
    room.check_room(1 << 30, 32768)


class _Props:
    def __init__(self, total: int) -> None:
        self.total_memory = total


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, total: int, allocated: int) -> torch.device:
    """A CUDA device of ``total`` bytes of which this process's tensors hold ``allocated``
    (no GPU needed); the driver is not to be asked (a call a hit would wait on)."""
    dev = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d=None: _Props(total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: allocated)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d=None: pytest.fail("asked"))
    return dev


def test_the_room_on_a_cuda_device_is_its_memory_less_what_this_process_holds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    dev = _fake_cuda(monkeypatch, total=5 << 30, allocated=3 << 30)
    assert room.device_room(dev) == 2 << 30
    assert room.device_room(torch.device("cpu")) is None
    monkeypatch.setattr(room, "host_room", lambda: 64 << 30)  # the host's room is not asked
    with pytest.raises(TooLarge, match=r"decodes to 3\.0 GiB .* device cuda:0 has 2\.0 GiB"):
        room.check_room(3 << 30, 49152, device=dev)
    room.check_room(2 << 30, 32768, device=dev)


def test_a_decoder_to_a_cuda_device_asks_the_device_before_allocating(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA-target decode of the lying entry ended in torch's out-of-memory error: the
    decoder now asks the device for room (a stand-in device here), as a host decode asks the
    host."""
    from kdn.codec import api

    parts = declaring(_constant(), 8192)  # 0.5 GiB decoded
    dev = _fake_cuda(monkeypatch, total=1 << 30, allocated=(1 << 30) - (128 << 20))
    monkeypatch.setattr(api, "target_device", lambda d: dev)
    monkeypatch.setattr(room, "host_room", lambda: 64 << 30)
    with pytest.raises(TooLarge, match=r"decodes to 0\.5 GiB \(8192 tokens\); device cuda:0"):
        codec.StreamDecoder(parts.header, "cuda")
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 0)
    assert codec.StreamDecoder(parts.header, "cuda").device == dev  # room enough: no refusal


def test_the_whole_entry_decoder_asks_for_room_before_planning(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole-entry (GPU) decoder, given the lying entry's bodies, refuses them as TooLarge
    from their specs alone, before any copy, plan or launch (the CPU stands in for the device:
    the same call asks the host)."""
    from kdn.codec import gpu_batch
    from kdn.codec.api import layer_spec
    from kdn.codec.modes import get_mode

    parts = declaring(_constant(), 8192)
    c = fmt.parse_container(parts.to_bytes())
    recs = [r for i, f in enumerate(c.frames) for r in fmt.check_frame(c.header, i, f)]
    specs = [layer_spec(c.header.layout, r.layer, r.tokens) for r in recs]
    monkeypatch.setattr(room, "host_room", lambda: 256 << 20)
    gpu_batch.STATS.update(launches=0, copies=0, syncs=0)
    with pytest.raises(TooLarge, match=r"decodes to 0\.5 GiB \(8192 tokens\); this host"):
        get_mode("kdn").decode_layers([memoryview(r.body) for r in recs], specs, "default",
                                      torch.device("cpu"))
    assert gpu_batch.STATS == {"launches": 0, "copies": 0, "syncs": 0}


def test_a_device_out_of_memory_at_the_whole_entry_output_is_too_large(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What the room does not count (other processes' memory on the device) can still leave
    the output's allocation short: torch's out-of-memory error there is TooLarge too."""
    from kdn.codec import gpu_batch

    def short(*args: object, **kwargs: object) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    monkeypatch.setattr(gpu_batch.torch, "empty", short)
    with pytest.raises(TooLarge, match=r"decode to 1\.0 GiB, more than device cpu has free"):
        gpu_batch._output(1 << 29, torch.float16, torch.device("cpu"))  # noqa: SLF001


def test_the_room_asked_counts_the_decoders_working_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A kdn or cachegen layer decodes through int32 symbols (twice its float16 output) and
    float32 products: an entry checked against its output alone passed a host with room for
    the output, then grew the process by ~5 times that. The room asked now counts the
    decoders' working memory, as many layers of it as decode at once; verbatim modes none."""
    from kdn.codec import api

    monkeypatch.setattr(api, "DECODERS", 2)
    parts = declaring(_constant(), 8192)  # 0.5 GiB decoded: 32 layers of 8 heads x 128
    declared = 32 * 8 * 8192 * 64 * 2 * 2
    work = 2 * (4 * 8 * 8192 * 128 + 2 * codec.quant.DEQUANTIZE_CHUNK_BYTES) \
        + api.DECODER_CODE_BYTES
    monkeypatch.setattr(room, "host_room", lambda: declared + work - 1)
    with pytest.raises(TooLarge, match=r"decodes to 0\.5 GiB \(8192 tokens\), and its decoders "
                       r"0\.1 GiB more at once"):
        codec.StreamDecoder(parts.header)
    monkeypatch.setattr(room, "host_room", lambda: declared + work)
    codec.StreamDecoder(parts.header)
    raw = declaring(_constant(), 8192, "lossless", "")
    monkeypatch.setattr(room, "host_room", lambda: declared + 2 * declared // 32 - 1)
    with pytest.raises(TooLarge, match="its decoders"):
        codec.StreamDecoder(raw.header)


def test_a_cpu_decode_stays_within_the_room_it_asked(tmp_path: Path) -> None:
    """The decode's growth, measured in a child (its high-water mark reset first), within
    what ``StreamDecoder`` asked the host for: the output, the symbols and one chunk of
    products per layer (the whole layer's products, clamp and permuted copy took ~4 times
    the output more)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux's /proc/self/clear_refs")
    child = textwrap.dedent("""
        import sys, torch
        from kdn import codec
        from kdn.cache import KVCache
        from kdn.codec import api, room
        from kdn.layout import KVLayout, LayerLayout
        lay = KVLayout("m", (LayerLayout(8, 64, 64),), head_dim=64)
        z = torch.zeros(8, 60000, 64, dtype=torch.float16)  # 117 MiB decoded
        blob = codec.encode(KVCache(lay, [(z, z)], 0), sys.argv[1], sys.argv[2])
        del z
        codec.decode(codec.encode(KVCache(lay, [(torch.ones(8, 4, 64).half(),) * 2], 0),
                                  sys.argv[1], sys.argv[2]))  # the decoder's code loaded
        asked = []
        room.check_room = lambda declared, *a, work=0, **k: asked.append(declared + work)
        api.check_room = room.check_room
        def status(name):
            return next(int(x.split()[1]) for x in open("/proc/self/status")
                        if x.startswith(name)) * 1024
        open("/proc/self/clear_refs", "w").write("5")  # the high-water mark reset
        base = status("VmRSS:")
        out = codec.decode(blob)
        print(status("VmHWM:") - base, asked[0])
        """)
    for mode, level in (("kdn", "default"), ("cachegen", "")):
        out = subprocess.run([sys.executable, "-c", child, mode, level], capture_output=True,
                             text=True, timeout=120, cwd=Path(__file__).resolve().parents[1])
        assert out.returncode == 0, out.stderr[-2000:]
        grew, asked = map(int, out.stdout.split())
        assert grew <= asked, (mode, grew >> 20, asked >> 20)
