"""The in-process tier (kdn.client.local): an LRU in front of the server, same keys, checksums
checked on every use, visible to lookup, the engine's timings and the loading controller."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import Client, landing
from kdn.client.local import LocalTier
from kdn.codec import EncodedParts, encode_parts, inplace
from kdn.delivery import LoadingController
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import InvalidLayout, LayoutMismatch
from kdn.layout import DType, Expected, KVLayout
from kdn.options import StoreOptions
from kdn.server import ServerThread
from tests.helpers import (
    count_staging_copies,
    pruned_layout,
    random_kv,
    uniform_layout,
    without_directory,
)
from tests.test_blend import ids, tiny
from tests.test_rag import CharTokenizer

LAYOUT = uniform_layout()


def _key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


def test_lru_by_bytes() -> None:
    parts = [codec.encode_parts(random_kv(LAYOUT, 20, seed=i), "raw") for i in range(4)]
    size = parts[0].nbytes
    tier = LocalTier(3 * size)
    for i in range(3):
        tier.put("ns", _key(i), parts[i])
    assert tier.get("ns", _key(0)) is not None  # 0 is now the most recent
    tier.put("ns", _key(3), parts[3])  # over budget: 1, the least recent, goes
    assert tier.contains("ns", _key(1)) is None and tier.stats.evictions == 1
    assert tier.contains("other", _key(0)) is None  # namespaces are apart
    got = tier.get("ns", _key(3))
    assert got is not None and codec.decode(got[0].to_bytes()).equal(random_kv(LAYOUT, 20, seed=3))
    assert got[1].readonly and bytes(got[1]) == got[0].to_bytes()
    tier.discard("ns", _key(3))
    assert tier.get("ns", _key(3)) is None
    assert (tier.stats.hits, tier.stats.misses, tier.stats.entries) == (2, 1, 2)
    tier.put("ns", _key(9), codec.encode_parts(random_kv(LAYOUT, 200, seed=9), "raw"))
    assert tier.contains("ns", _key(9)) is None  # larger than the whole tier: not kept


def _served(client: Client) -> int:
    c = client.stats().counters
    return int(c.get("getmany.hit", 0) + c.get("retrieve.hit", 0))


class _FakeCudart:
    """``cudaHostRegister`` / ``cudaHostUnregister`` as a CUDA host would take them."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, size))
        self.registered[ptr] = size
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr, self.registered.pop(ptr)))
        return 0


def test_pinned_entries_cost_their_size_and_are_unpinned_when_the_last_view_goes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CUDA host the tier's entries are page-locked for copies to the GPU: each takes
    its own size rounded to pages (torch's pinned allocator rounded each to a power of two,
    an entry of 32 MiB and a header taking 64 MiB, and kept every freed block pinned), and an
    evicted entry is unpinned once nothing views it, not while a copy may still read it."""
    import gc
    import mmap


    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    parts = [codec.encode_parts(random_kv(LAYOUT, 300, seed=i), "raw") for i in range(3)]
    size = parts[0].nbytes
    assert size & (size - 1)  # not a power of two: rounding up would show
    tier = LocalTier(2 * size + 1)
    assert tier.pinned
    tier.put("ns", _key(0), parts[0])
    tier.put("ns", _key(1), parts[1])
    pinned = sum(cudart.registered.values())
    page = mmap.PAGESIZE
    assert pinned <= 2 * (size + 64 + page)  # exact to a page, the 64 B alignment slack aside
    got = tier.get("ns", _key(0))  # a view a copy could be reading from
    assert got is not None
    held = np.frombuffer(got[1], dtype=np.uint8).ctypes.data
    ptr_of = {p: sz for p, sz in cudart.registered.items() if p <= held < p + sz}
    assert len(ptr_of) == 1
    tier.put("ns", _key(2), parts[2])  # over budget: 1 goes (0 was used last)
    tier.discard("ns", _key(0))  # and 0, while its view is held
    gc.collect()
    unpinned = [c for c in cudart.calls if c[0] == "unregister"]
    assert len(unpinned) == 1 and unpinned[0][1] not in ptr_of  # 1 only: 0 is still viewed
    assert bytes(got[1]) == parts[0].to_bytes()  # and still readable
    del got
    gc.collect()
    assert [c[1] for c in cudart.calls if c[0] == "unregister"][1:] == list(ptr_of)
    assert len(cudart.registered) == 1  # entry 2 only


@pytest.mark.parametrize("shm", [None, 0], ids=["segment", "stream"])
def test_hits_cost_no_call_to_the_server(server: ServerThread, shm: int | None,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    without_directory(monkeypatch)  # the first read is a call (the arena's directory aside)
    with Client(server.address, shm_bytes=shm, local_bytes=8 << 20) as c, \
            Client(server.address) as other:
        kv = random_kv(pruned_layout(), 30, seed=1)
        other.store(_key(1), kv)
        before = _served(c)
        assert c.retrieve(_key(1), layout=pruned_layout()).equal(kv)  # type: ignore[union-attr]
        assert _served(c) == before + 1  # the first read went to the server and filled L1
        info = c.lookup([_key(1), _key(2)]).infos
        assert (info[0].tier, info[1].present) == ("inproc", False)
        for _ in range(3):
            stream = c.retrieve_stream(_key(1))
            assert stream is not None and stream.tier == "inproc"
            assert stream.result().equal(kv)
        assert c.fetch_many([_key(1)])[0].tier == "inproc"  # type: ignore[union-attr]
        assert _served(c) == before + 1
        with pytest.raises(LayoutMismatch):
            c.retrieve(_key(1), layout=LAYOUT)
        mine = random_kv(LAYOUT, 12, seed=2)
        c.store(_key(3), mine)  # filled on store
        assert c.lookup([_key(3)]).infos[0].tier == "inproc"
        c.delete(_key(3))
        assert c.retrieve(_key(3)) is None


@pytest.mark.parametrize("shm", [None, 0], ids=["segment", "stream"])
def test_an_entry_stored_with_a_ttl_leaves_the_tier_when_it_expires(
        server: ServerThread, shm: int | None) -> None:
    with Client(server.address, shm_bytes=shm, local_bytes=8 << 20) as c:
        kv = random_kv(LAYOUT, 12, seed=3)
        c.store(_key(1), kv, options=StoreOptions(ttl_s=1))
        c.store_many([(_key(2), kv)], options=StoreOptions(ttl_s=1))
        c.store(_key(3), kv)
        assert [i.tier for i in c.lookup([_key(1), _key(2), _key(3)]).infos] == ["inproc"] * 3
        time.sleep(1.1)
        infos = c.lookup([_key(1), _key(2), _key(3)]).infos
        assert [i.present for i in infos[:2]] == [False, False] and infos[2].tier == "inproc"
        assert c.retrieve(_key(1)) is None and c.retrieve(_key(2)) is None
        assert c.local.stats.entries == 1


def test_damaged_entries_are_never_kept(server: ServerThread) -> None:
    kv, other = random_kv(LAYOUT, 16, seed=4), random_kv(LAYOUT, 16, seed=5)
    with Client(server.address, shm_bytes=0, local_bytes=8 << 20) as c:
        assert c.local is not None
        c.store(_key(4), kv, mode="raw")  # kept: the key is in the process
        good = encode_parts(other, "raw")
        head = len(good.header)
        for where in ("header", "body", "tokens"):
            frames = [bytearray(f) for f in good.frames]
            header = bytearray(good.header)
            if where == "header":
                header[head // 2] ^= 0x01
            elif where == "body":
                frames[-1][-2] ^= 0xFF
            else:
                frames[0][16 + 2] ^= 0x01  # the first record's token count: the sum covers it
            bad = EncodedParts(bytes(header), [bytes(f) for f in frames])
            assert c.local.put("default", _key(4), bad) is False
            assert c.local.get("default", _key(4)) is None  # the older copy went too
            c.local.put("default", _key(4), encode_parts(kv, "raw"))
        assert c.local.stats.refused == 3
        got = c.retrieve(_key(4))
        assert got is not None and got.equal(kv)


def test_a_hit_is_one_copy_the_caller_owns(server: ServerThread,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    lay = pruned_layout()
    kv = random_kv(lay, 24, seed=6)
    with Client(server.address, shm_bytes=0, local_bytes=8 << 20) as c:
        c.store(_key(6), kv, mode="raw", layers_per_frame=2)
        calls: list[bool] = []
        real = inplace.copied

        def spy(header, container, pool=None, verify=True):  # type: ignore[no-untyped-def]
            got = real(header, container, pool, verify)
            calls.append(got is not None and not verify)  # checked when it came in
            return got

        monkeypatch.setattr(inplace, "copied", spy)
        first = c.retrieve(_key(6), layout=lay)
        assert first is not None and first.equal(kv) and calls == [True]
        first.layers[0][0].zero_()  # the caller's own copy: the tier's bytes are not touched
        again = c.retrieve(_key(6), layout=lay)
        assert again is not None and again.equal(kv) and calls == [True, True]
        assert _served(c) == 0  # both from the process


def test_engine_reads_blocks_from_its_process_and_the_controller_knows(
        server: ServerThread) -> None:
    # a link so slow only L1 can win; lossless decodes at 1 GB/s here (known, so not timed:
    # what is tested is the path the controller weighs, not this host's decode speed)
    controller = LoadingController(bandwidth_b_s=1.0, decode_b_s={"lossless@cpu": 1e9})
    model = tiny("llama")
    import tempfile
    from pathlib import Path

    from kdn.server import ServerConfig

    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(port=0, data_dir=Path(tmp) / "d", ram_bytes=64 << 20,
                           disk_bytes=0)
        with ServerThread(cfg) as st, Client(st.address, local_bytes=64 << 20) as c:
            engine = KDNEngine(model, CharTokenizer(), c, EngineConfig(chunk_tokens=16),
                               controller)
            prompt = ids(70, seed=5)
            first = engine.generate(prompt, max_new_tokens=3)
            engine.wait_for_save(30)
            again = engine.generate(prompt, max_new_tokens=3)
            assert again.timings.decision == "lossless" and again.timings.local_blocks == 4
            assert again.token_ids == first.token_ids
            assert controller.estimate("lossless", 10**9, 10**6, local=True) < \
                controller.estimate("lossless", 10**9, 10**6)


@pytest.mark.parametrize("local", [64 << 20, 0], ids=["in-process", "stream"])
def test_recycled_decode_buffers_never_change_tensors_still_held(server: ServerThread,
                                                                 local: int) -> None:
    """Decoded copies (in-process hits, and streamed frames decoded into one arena) live in
    pooled buffers: a buffer serves the next decode only once no tensor views it."""
    lay = uniform_layout(layers=4, heads=8, dim=64)  # 8 KiB a token: entries over MIN_BYTES
    a, b = random_kv(lay, 200, seed=7), random_kv(lay, 200, seed=8)
    with Client(server.address, shm_bytes=0, local_bytes=local) as c:
        c.store(_key(7), a, mode="raw")
        c.store(_key(8), b, mode="raw")
        held = c.retrieve(_key(7), layout=lay)
        assert held is not None
        net = c.dataplane.net()  # entries read on the data path land in its own pool

        def pooled() -> int:
            return inplace.BUFFERS.reused + (net.landing.reused if net is not None else 0)

        reused = pooled()
        for _ in range(5):  # each result dropped at once: its buffer serves the next
            got = c.retrieve(_key(8), layout=lay)
            assert got is not None and got.equal(b)
            got.layers[0][0].fill_(0)  # what a caller does with its own tensors
            del got
        assert pooled() >= reused + 4
        assert held.equal(a)  # its buffer was never handed out again
        k0 = held.layers[0][0][0]  # a view of a view keeps the buffer too
        del held
        for _ in range(3):
            assert c.retrieve(_key(8), layout=lay).equal(b)  # type: ignore[union-attr]
        assert torch.equal(k0, a.layers[0][0][0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_hit_bound_for_the_gpu_copies_from_the_pinned_tier(server: ServerThread,
                                                              monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    lay = pruned_layout()
    kv = random_kv(lay, 64, seed=11)
    with Client(server.address, shm_bytes=0, local_bytes=8 << 20) as c:
        c.store(_key(11), kv, mode="raw")
        copies: list[int] = []
        real = inplace.copied
        monkeypatch.setattr(inplace, "copied", lambda *a: copies.append(1) or real(*a))
        staged = count_staging_copies(monkeypatch)
        back = c.retrieve(_key(11), layout=lay, device="cuda")
        assert back is not None and all(k.is_cuda and v.is_cuda for k, v in back.layers)
        assert back.to("cpu").equal(kv) and not copies and not staged  # straight from the tier
        assert _served(c) == 0


def test_a_tier_hit_is_viewed_where_it_lies_for_a_copy_to_a_device(server: ServerThread) -> None:
    """The tier keeps an entry's frames aligned as the decoder's plan needs, so a hit bound
    for a GPU is viewed in place (the copy's source) instead of decoded into another buffer
    first (which made GPU-bound tier hits run at a fraction of the pinned rate)."""

    from kdn.client.landing import decoder_for

    lay = uniform_layout(layers=4, heads=2, dim=64)
    with Client(server.address, shm_bytes=0, local_bytes=8 << 20) as c:
        for i, tokens in enumerate((33, 1000, 70_000 // 64)):  # headers of several lengths
            kv = random_kv(lay, tokens, seed=12 + i)
            c.store(_key(20 + i), kv, mode="raw")
            got = c._reads.in_process("default", _key(20 + i), Expected.of(lay))  # noqa: SLF001
            assert got is not None and got.container is not None
            first_frame = np.frombuffer(got.parts.frames[0], dtype=np.uint8).ctypes.data
            assert first_frame % 64 == 0, len(got.parts.header)
            dec, _ = decoder_for(got.parts.header, "cuda", got)
            span = dec.staging_span(list(got.parts.frames), got.container)  # type: ignore[arg-type]
            assert span is not None
            views = span.views()
            assert all(torch.equal(a, b) for (a, b) in zip(
                (t for pair in views for t in pair), (t for pair in kv.layers for t in pair)))
            frames = np.frombuffer(got.container, dtype=np.uint8)[len(got.parts.header):]
            assert span.base.data_ptr() == frames.ctypes.data  # every frame, where it lies
            assert span.base.numel() * span.base.element_size() == frames.nbytes


def _raw_context(c: Client, layout: KVLayout, n: int, tokens: int, first: int
                 ) -> tuple[list[KVCache], list[bytes]]:
    """``n`` consecutive blocks of ``tokens`` each stored ``raw`` under keys ``first``..."""
    blocks = [random_kv(layout, tokens, seed=first + i, start=tokens * i) for i in range(n)]
    for i, kv in enumerate(blocks):
        c.store(_key(first + i), kv, mode="raw")
    return blocks, [_key(first + i) for i in range(n)]


@pytest.mark.parametrize("layout", [uniform_layout(layers=5, heads=2, dim=32), pruned_layout(),
                                    uniform_layout(dtype=DType.BFLOAT16)],
                         ids=["uniform", "pruned", "bf16"])
def test_a_context_held_in_process_comes_back_as_one_joined_stream(
        server: ServerThread, layout: KVLayout) -> None:
    """Consecutive blocks of one context, all in the in-process tier: one stream of the whole
    context, each layer's K and V joined along tokens, equal to the blocks' own layers
    joined; the tier's bytes are only its sources (writing the result changes nothing
    stored). Anything else is not joined: a block missing, another mode, blocks of unequal
    lengths."""
    with Client(server.address, shm_bytes=0, local_bytes=64 << 20) as c:
        blocks, keys = _raw_context(c, layout, 4, 24, first=60)
        st = c.retrieve_joined(keys, layout=layout, device="cpu")
        assert st is not None and st.blocks == 4 and st.num_tokens == 96
        assert st.tier == "inproc"
        got = st.result()
        assert got.start_position == 0
        for i, (k, v) in enumerate(got.layers):
            assert torch.equal(k, torch.cat([b.layers[i][0] for b in blocks], dim=1))
            assert torch.equal(v, torch.cat([b.layers[i][1] for b in blocks], dim=1))
            k.fill_(0)
            v.fill_(0)
        again = c.retrieve_joined(keys, layout=layout, device="cpu")
        assert again is not None
        assert torch.equal(again.result().layers[-1][1],
                           torch.cat([b.layers[-1][1] for b in blocks], dim=1))
        assert c.retrieve_joined(keys + [_key(99)], layout=layout, device="cpu") is None
        assert c.retrieve_joined([keys[0], keys[2]], layout=layout, device="cpu") is None  # a gap
        c.store(_key(70), blocks[0], mode="lossless")
        assert c.retrieve_joined([_key(70), keys[1]], layout=layout, device="cpu") is None
        c.store(_key(71), random_kv(layout, 20, seed=9, start=96), mode="raw")
        assert c.retrieve_joined(keys + [_key(71)], layout=layout, device="cpu") is None
        assert c.retrieve_joined(keys[:1], layout=layout, device="cpu") is not None


def test_blocks_of_equal_shapes_but_other_layouts_are_not_joined(server: ServerThread) -> None:
    """Without ``layout=``, blocks whose K/V shapes and dtype agree but whose layouts do not
    (another model's; another pruning's, keeping other channels in the same counts) are not
    one context: no joined stream (it would be labelled with the first block's layout), as
    ``KVCache.concat`` refuses them too. Blocks of one layout still join."""
    layout = pruned_layout()
    lay = layout.layers[2]
    others = {
        "another model": replace(layout, model_fingerprint="other-model"),
        "other kept channels": replace(layout, layers=(
            *layout.layers[:2], replace(lay, v_kept=tuple(range(lay.v_channels))),
            *layout.layers[3:])),
    }
    with Client(server.address, shm_bytes=0, local_bytes=64 << 20) as c:
        blocks, keys = _raw_context(c, layout, 2, 8, first=110)
        st = c.retrieve_joined(keys)
        assert st is not None and st.result().layout == layout
        for j, (what, other) in enumerate(others.items()):
            assert other.fingerprint != layout.fingerprint, what
            mixed = KVCache(other, blocks[1].layers, start_position=8)
            with pytest.raises(InvalidLayout, match="different layouts"):
                KVCache.concat([blocks[0], mixed])
            c.store(_key(120 + j), mixed, mode="raw")
            assert c.retrieve_joined([keys[0], _key(120 + j)]) is None, what
            with pytest.raises(LayoutMismatch):  # named: a block not of it is refused
                c.retrieve_joined([keys[0], _key(120 + j)], layout=layout)


def test_a_repeated_hit_derives_nothing_and_an_entry_replaced_or_gone_takes_it_along(
        server: ServerThread) -> None:
    """A tier hit hands out what was parsed when the entry was put, and the span a load
    derived from it the first time (``LocalHit.memo``); an entry put again under its key
    starts afresh (its new bytes, its own span), and one that is gone frees what was derived
    from it (nothing else holds its bytes)."""
    import gc
    import weakref

    layout = uniform_layout(layers=4, heads=2, dim=16)
    with Client(server.address, shm_bytes=0, local_bytes=64 << 20) as c:
        blocks, keys = _raw_context(c, layout, 3, 16, first=80)
        assert c.local is not None
        hit = c.local.get("default", keys[1])
        assert hit is not None and hit.memo == {}
        assert c.local.get("default", keys[1]) is hit  # nothing parsed again
        c.retrieve_joined(keys, layout=layout, device="cpu")
        span = hit.memo["span"]
        assert span is not None and span.base.data_ptr() == \
            np.frombuffer(hit.whole, dtype=np.uint8).ctypes.data + len(hit.parts.header)
        st = c.retrieve_joined(keys, layout=layout, device="cpu")
        assert st is not None and c.local.get("default", keys[1]).memo["span"] is span
        other = random_kv(layout, 16, seed=5, start=16)
        c.store(keys[1], other, mode="raw")  # the same key, other bytes
        fresh = c.local.get("default", keys[1])
        assert fresh is not None and fresh is not hit and fresh.memo == {}
        again = c.retrieve_joined(keys, layout=layout, device="cpu")
        assert again is not None
        assert torch.equal(again.result().layers[2][0][:, 16:32], other.layers[2][0])
        assert fresh.memo["span"] is not span
        gone = weakref.ref(fresh.memo["span"].base)
        del fresh, again, st, span, hit
        c.local.discard("default", keys[1])
        gc.collect()
        assert gone() is None  # the derived views went with the entry


def test_the_engine_loads_a_context_held_in_process_as_one_stream(server: ServerThread
                                                                  ) -> None:
    """A hit whose blocks are all in the in-process tier loads as one joined stream: every
    block counted as local, and the tokens generated are those of a full prefill."""
    model = tiny("llama").to(torch.bfloat16)  # raw entries of 2-byte KV are viewed in place
    with Client(server.address, local_bytes=64 << 20) as c:
        engine = KDNEngine(model, CharTokenizer(), c,
                           EngineConfig(chunk_tokens=16, encodings=(("raw", ""),)))
        prompt = ids(70, seed=6)
        first = engine.generate(prompt, max_new_tokens=3)
        engine.wait_for_save(30)
        joined = []
        real = c.retrieve_joined

        def spy(*args: object, **kwargs: object) -> object:
            joined.append(real(*args, **kwargs))  # type: ignore[arg-type]
            return joined[-1]

        c.retrieve_joined = spy  # type: ignore[method-assign]
        again = engine.generate(prompt, max_new_tokens=3, force="raw")
        assert joined and joined[-1] is not None and joined[-1].blocks == 4
        assert again.timings.reused_tokens == 64 and again.timings.local_blocks == 4
        full = engine.generate(prompt, max_new_tokens=3, force="recompute")
        assert again.token_ids == full.token_ids == first.token_ids


@pytest.mark.parametrize("layout", [uniform_layout(layers=7, heads=2, dim=32), pruned_layout()],
                         ids=["uniform", "pruned"])
def test_a_joined_load_crosses_in_layer_groups_each_in_its_own_range(
        server: ServerThread, layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The layer groups of a joined GPU load: consecutive layers, every layer once, each
    group's range of the entry after the last one's, and the group ranges alone, copied,
    hold every K and V (what lies between is never read); small entries cross whole."""
    with Client(server.address, shm_bytes=0, local_bytes=32 << 20) as c:
        blocks, keys = _raw_context(c, layout, 1, 40, first=110)
        got = c._reads.in_process("default", keys[0], Expected.of(layout))  # noqa: SLF001
        assert got is not None and got.container is not None
        dec, _ = landing.decoder_for(got.parts.header, "cuda", got)
        span = dec.staging_span(list(got.parts.frames), got.container)  # type: ignore[arg-type]
        assert span is not None
        size = span.base.numel() * span.base.element_size()
        assert landing.copy_groups(span.specs, size) == [(0, layout.num_layers, 0,
                                                           span.base.numel())]
        monkeypatch.setattr(landing, "LAYER_GROUP_BYTES", size // 5)
        groups = landing.copy_groups(span.specs, size)
        even = landing.layer_groups(layout.num_layers, 5)
        tail = (even[-1][1] - even[-1][0]) // 4  # the last group's last quarter crosses alone
        assert [g[:2] for g in groups] == even[:-1] + (
            [(even[-1][0], even[-1][1] - tail), (even[-1][1] - tail, even[-1][1])] if tail
            else even[-1:])
        assert len(groups) == min(5, layout.num_layers) + (tail > 0)
        assert [g[0] for g in groups] == [0] + [g[1] for g in groups[:-1]]
        assert groups[-1][1] == layout.num_layers
        assert all(a[3] <= b[2] and a[2] < a[3] for a, b in zip(groups, groups[1:]))
        copied = torch.zeros_like(span.base)
        for first, end, lo, hi in groups:
            copied[lo:hi] = span.base[lo:hi]
            for i in range(first, end):
                for j, t in ((2 * i, blocks[0].layers[i][0]), (2 * i + 1, blocks[0].layers[i][1])):
                    shape, stride, at = span.specs[j]
                    assert lo <= at and torch.equal(copied.as_strided(shape, stride, at), t)
        shuffled = (span.specs[2], span.specs[3], span.specs[0], span.specs[1]) + span.specs[4:]
        assert len(landing.copy_groups(shuffled, size)) == 1  # not in layer order: one group


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("group_bytes", [8 << 20, 1], ids=["whole", "groups"])
def test_a_joined_context_lands_on_the_gpu_from_the_pinned_tier(
        server: ServerThread, monkeypatch: pytest.MonkeyPatch, group_bytes: int) -> None:
    """Bound for a GPU, the joined stream copies each entry's pinned bytes once (no staging
    copy) and joins on the device: the same tensors as the CPU join, usable on the current
    stream once awaited, and on another stream too; whole entries, or in layer groups."""
    monkeypatch.setattr(landing, "LAYER_GROUP_BYTES", group_bytes)
    lay = pruned_layout()
    with Client(server.address, shm_bytes=0, local_bytes=32 << 20) as c:
        _, keys = _raw_context(c, lay, 5, 32, first=80)
        cpu = c.retrieve_joined(keys, layout=lay, device="cpu")
        staged = count_staging_copies(monkeypatch)
        gpu = c.retrieve_joined(keys, layout=lay, device="cuda")
        assert cpu is not None and gpu is not None and not staged
        other = torch.cuda.Stream()
        with torch.cuda.stream(other):
            layer0 = gpu.wait_for_layer(0)
            assert torch.equal(layer0[0].cpu(), cpu.wait_for_layer(0)[0])
        got = gpu.result()
        assert all(k.is_cuda and v.is_cuda for k, v in got.layers)
        assert got.to("cpu").equal(cpu.result())
