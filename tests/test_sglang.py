"""The kdn HiCache backend against SGLang's own code: the same calls on HiCacheFile and on kdn.

Both backends come from SGLang's ``StorageBackendFactory`` (kdn through its ``dynamic`` path,
with the extra-config an engine is launched with), get a host pool registered the way SGLang's
cache controller does, and answer one sequence of calls: existence prefixes, pages written
from and read back into the host pool by index (kdn: ``batch_*_v1``; HiCacheFile: its
``batch_*_v2`` of the KV pool, the same reads and writes), the copying ``get``/``set`` paths,
misses after a page is deleted or evicted, and ``clear``. Results must be identical, bytes
included. The host pool is ``bench.sglang.HostPool``: SGLang's ``MHATokenToKVPoolHost`` can
not be imported on a CPU-only host (its package imports torchvision, whose PyPI wheel needs
CUDA torch); HostPool has the same buffers, page layouts and page methods.

Skipped when sglang is not installed (``scripts/bootstrap.sh test`` installs it).
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheFile,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

from bench.sglang import HostPool, file_backend, kdn_backend  # noqa: E402
from kdn.client.admin import AdminClient  # noqa: E402
from kdn.client.client import Client  # noqa: E402
from kdn.client.received import Fetched  # noqa: E402
from kdn.codec.format import FRAME_STRUCT, RECORD_BYTES, EncodedParts  # noqa: E402
from kdn.errors import ConfigError, InvalidArgument, InvalidLayout  # noqa: E402
from kdn.integrations.sglang import KDNHiCacheStorage  # noqa: E402
from kdn.integrations.sglang_config import KDNBackendConfig  # noqa: E402
from kdn.keys import page_key  # noqa: E402
from kdn.server import ServerThread  # noqa: E402
from tests.helpers import make_certs, random_kv, uniform_layout  # noqa: E402

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]
SMALL = {"layers": 3, "heads": 2, "head_dim": 16, "page_size": 4}
KEYS = [f"{j:02d}" + "ab" * 31 for j in range(8)]  # SGLang's page keys are hex digests


def pool_pair(layout: str, pages: int = 16) -> tuple[HostPool, HostPool]:
    """Two pools of identical random content, one per backend."""
    a = HostPool(layout, pages, seed=1, **SMALL)  # type: ignore[arg-type]
    b = HostPool(layout, pages, seed=1, **SMALL)  # type: ignore[arg-type]
    return a, b


def kv_transfer(keys: list[str], idx: torch.Tensor) -> list[PoolTransfer]:
    return [PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys)]


class Pair:
    """HiCacheFile and the kdn backend, called alike; every answer compared."""

    def __init__(self, file: Any, kdn: KDNHiCacheStorage, fpool: HostPool, kpool: HostPool,
                 folder: Path, admin: AdminClient) -> None:
        self.file, self.kdn, self.fpool, self.kpool = file, kdn, fpool, kpool
        self.folder, self.admin = folder, admin

    def same(self, name: str, *args: Any) -> Any:
        f = getattr(self.file, name)(*args)
        k = getattr(self.kdn, name)(*args)
        assert f == k, (name, f, k)
        return k

    def set_pages(self, keys: list[str], pages: list[int]) -> list[bool]:
        f = self.file.batch_set_v2(kv_transfer(keys, self.fpool.indices(pages)))[PoolName.KV]
        k = self.kdn.batch_set_v1(keys, self.kpool.indices(pages))
        assert f == k
        return k

    def get_pages(self, keys: list[str], pages: list[int]) -> list[bool]:
        f = self.file.batch_get_v2(kv_transfer(keys, self.fpool.indices(pages)))[PoolName.KV]
        k = self.kdn.batch_get_v1(keys, self.kpool.indices(pages))
        assert f == k
        assert torch.equal(self.fpool.kv_buffer.view(torch.int16),
                           self.kpool.kv_buffer.view(torch.int16))  # bytes of the pools
        return k

    def exists_prefix(self, keys: list[str]) -> int:
        n = self.same("batch_exists", keys)
        f = self.file.batch_exists_v2(keys)
        k = self.kdn.batch_exists_v2(keys)
        assert (f.kv_hit_pages, f.extra_pool_hit_pages, f.restorable_prefix_pages) == \
            (k.kv_hit_pages, k.extra_pool_hit_pages, k.restorable_prefix_pages) and \
            k.kv_hit_pages == n
        for key in keys:
            self.same("exists", key)
        return n

    def drop(self, key: str, evict: bool = False) -> None:
        """Remove one page from both stores: HiCacheFile's file (what its LRU evictor
        unlinks), kdn's entry (a client delete, or an operator's evict from every tier: an
        entry evicted from RAM alone is still served from disk)."""
        files = glob.glob(os.path.join(self.folder, f"{key}*.bin"))
        assert len(files) == 1
        os.remove(files[0])
        kkey = self.kdn.kdn_key(key)
        if evict:  # out of the RAM tier, then the disk tier (the server's tiers here)
            ns = self.kdn.config.namespace
            assert [self.admin.evict([kkey], ns, tier) for tier in ("ram", "disk")] == [1, 1]
        else:
            assert self.kdn.client.delete(kkey) == 1


@pytest.fixture(params=LAYOUTS)
def pair(request: pytest.FixtureRequest, server: ServerThread, tmp_path: Path
         ) -> Iterator[Pair]:
    fpool, kpool = pool_pair(request.param)
    folder = tmp_path / "hicache"
    file = file_backend(fpool, folder)
    kdn = kdn_backend(kpool, server.address)
    admin = AdminClient(server.address)
    yield Pair(file, kdn, fpool, kpool, folder, admin)
    kdn.close()
    admin.close()


def test_factory_loads_kdn_through_the_dynamic_path(pair: Pair) -> None:
    assert isinstance(pair.file, HiCacheFile)
    assert type(pair.kdn) is KDNHiCacheStorage
    assert pair.kdn.config == KDNBackendConfig(address=pair.kdn.config.address)


def test_same_call_sequence_as_hicache_file(pair: Pair) -> None:
    p = pair
    keys = KEYS[:6]
    assert p.exists_prefix(keys) == 0
    assert p.get_pages(keys[:2], [8, 9]) == [False, False]

    # write pages 0..3 of the pool under keys 0..3; existence is a prefix count
    assert p.set_pages(keys[:4], [0, 1, 2, 3]) == [True] * 4
    assert p.exists_prefix(keys) == 4
    assert p.exists_prefix(keys[1:]) == 3
    assert p.exists_prefix([keys[5], *keys[:4]]) == 0
    assert p.set_pages(keys[:2], [0, 1]) == [True, True]  # already stored: accepted again

    # read them back into other slots: hits land byte for byte, misses leave slots alone
    untouched = p.kpool.kv_of(12)
    assert p.get_pages(keys, [8, 9, 10, 11, 12, 13]) == [True] * 4 + [False] * 2
    for j in range(4):
        assert torch.equal(p.kpool.kv_of(8 + j), p.kpool.kv_of(j))
    assert torch.equal(p.kpool.kv_of(12), untouched)

    # the copying interface: flat pages in the pool's own order
    page4 = p.kpool.get_data_page(4 * p.kpool.page_size, flat=True)
    assert p.same("set", keys[4], page4) is True
    assert p.same("batch_set", [keys[5]], [p.kpool.get_data_page(5 * p.kpool.page_size)])
    got_f = p.file.get(keys[4], p.fpool.get_dummy_flat_data_page())
    got_k = p.kdn.get(keys[4], p.kpool.get_dummy_flat_data_page())
    assert torch.equal(got_f, got_k) and torch.equal(got_k, page4)
    many_f = p.file.batch_get(keys[3:6] + [KEYS[7]],
                              [p.fpool.get_dummy_flat_data_page() for _ in range(4)])
    many_k = p.kdn.batch_get(keys[3:6] + [KEYS[7]],
                             [p.kpool.get_dummy_flat_data_page() for _ in range(4)])
    assert [t is None for t in many_f] == [t is None for t in many_k] == [False] * 3 + [True]
    assert all(torch.equal(a, b) for a, b in zip(many_f[:3], many_k[:3]))
    assert p.exists_prefix(keys) == 6

    # a deleted page and an evicted page are misses in both; the prefix stops at the first
    p.drop(keys[1])
    assert p.exists_prefix(keys) == 1
    assert p.same("exists", keys[1]) is False
    assert p.file.get(keys[1], p.fpool.get_dummy_flat_data_page()) is None
    assert p.kdn.get(keys[1], p.kpool.get_dummy_flat_data_page()) is None
    p.drop(keys[3], evict=True)
    assert p.exists_prefix(keys) == 1
    assert p.get_pages(keys, [8, 9, 10, 11, 12, 13]) == [True, False, True, False, True, True]
    assert p.set_pages([keys[1], keys[3]], [1, 3]) == [True, True]
    assert p.exists_prefix(keys) == 6

    # clear: every page gone
    assert p.same("clear") is True
    assert p.exists_prefix(keys) == 0
    assert p.get_pages(keys[:3], [8, 9, 10]) == [False] * 3


def test_v2_extra_pools_are_not_stored(pair: Pair) -> None:
    p = pair
    assert p.set_pages(KEYS[:3], [0, 1, 2]) == [True] * 3
    mamba = PoolTransfer(name=PoolName.MAMBA, keys=KEYS[2:3],
                         hit_policy=PoolHitPolicy.TRAILING_PAGES)
    f = p.file.batch_exists_v2(KEYS[:3], [mamba])
    k = p.kdn.batch_exists_v2(KEYS[:3], [mamba])
    assert (f.kv_hit_pages, f.extra_pool_hit_pages) == (k.kv_hit_pages, k.extra_pool_hit_pages)
    assert k.kv_hit_pages == 0 and k.extra_pool_hit_pages == {PoolName.KV: 3}
    res = p.kdn.batch_get_v2([*kv_transfer(KEYS[:3], p.kpool.indices([8, 9, 10])), mamba])
    assert res == {PoolName.KV: [True] * 3, PoolName.MAMBA: [False]}


def test_a_page_named_twice_in_one_write_is_stored_once(pair: Pair) -> None:
    """One batch naming a page twice is answered as HiCacheFile answers it (every page
    stored, read back byte for byte), its page sent once: one ``store_many`` takes each key
    once."""
    p = pair
    keys = [KEYS[0], KEYS[1], KEYS[0]]
    assert p.set_pages(keys, [0, 1, 0]) == [True] * 3
    assert p.kdn.stats().pages_written == 2
    assert p.get_pages(keys, [8, 9, 10]) == [True] * 3
    assert p.exists_prefix(KEYS[:2]) == 2


@pytest.mark.parametrize("src_layout,dst_layout", [("page_first", "layer_first"),
                                                    ("layer_first", "page_first_direct")])
def test_pages_do_not_depend_on_the_pool_layout(server: ServerThread, src_layout: str,
                                                dst_layout: str) -> None:
    src = HostPool(src_layout, 8, seed=3, **SMALL)  # type: ignore[arg-type]
    dst = HostPool(dst_layout, 8, **SMALL)  # type: ignore[arg-type]
    a, b = kdn_backend(src, server.address), kdn_backend(dst, server.address)
    try:
        assert a.batch_set_v1(KEYS[:3], src.indices([0, 1, 2])) == [True] * 3
        assert b.batch_exists(KEYS[:3]) == 3
        assert b.batch_get_v1(KEYS[:3], dst.indices([5, 6, 7])) == [True] * 3
        for j in range(3):
            assert torch.equal(dst.kv_of(5 + j), src.kv_of(j))
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_raw_pages_read_back_bit_exact(server: ServerThread, layout: str,
                                       dtype: torch.dtype) -> None:
    """``raw`` pages go straight from their frames into the pool (fp16 and bf16: the verbatim
    path; fp32 records are not element-aligned: the general decode)."""
    pool = HostPool(layout, 16, seed=4, dtype=dtype, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address, mode="raw", namespace="sglang-raw")
    try:
        assert b.batch_set_v1(KEYS, pool.indices(range(8))) == [True] * 8
        got = b.batch_get_v1(KEYS[::-1], pool.indices(range(8, 16)))
        assert got == [True] * 8
        for j in range(8):
            want = pool.kv_of(7 - j)
            assert pool.kv_of(8 + j).view(torch.uint8).equal(want.view(torch.uint8))
    finally:
        b.close()


def test_a_raw_record_of_another_shape_is_refused(server: ServerThread) -> None:
    """A ``raw`` page whose checksums pass (here: bytes the server says it checked) but one of
    whose layer records declares another shape is refused, naming the layer, and writes
    nothing into the pool."""
    pool = HostPool("layer_first", 4, seed=5, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address, mode="raw", namespace="sglang-raw")
    try:
        pages = b._need_pages()
        parts = pages.encode(pages.pool_page(0))
        frame = bytearray(parts.frames[0])
        rec = RECORD_BYTES + pool.page_size * SMALL["heads"] * SMALL["head_dim"] * 2 * 2
        at = FRAME_STRUCT.size + rec + 2  # layer 1's record: its token count
        frame[at : at + 4] = (SMALL["page_size"] + 1).to_bytes(4, "little")
        got = Fetched(EncodedParts(parts.header, [frame]), "ram", checked=True)
        target = pages.pool_page(3 * pool.page_size)
        before = target.clone()
        with pytest.raises(InvalidLayout, match="layer 1"):
            pages.place(got, target)
        assert torch.equal(target, before)
        intact = Fetched(EncodedParts(parts.header, [bytearray(parts.frames[0])]), "ram",
                         checked=True)
        pages.place(intact, target)
        assert torch.equal(pool.kv_of(3), pool.kv_of(0))
    finally:
        b.close()


def test_keys_carry_model_shard_page_size_adapter_and_salt(server: ServerThread) -> None:
    pool = HostPool("layer_first", 8, seed=4, **SMALL)  # type: ignore[arg-type]
    base = kdn_backend(pool, server.address)
    others = [
        kdn_backend(pool, server.address, {"model": "other/model"}),
        kdn_backend(pool, server.address, {"tp": (1, 2)}),
        kdn_backend(pool, server.address, {"pp": (1, 2)}),
        kdn_backend(pool, server.address, adapter="lora-1"),
        kdn_backend(pool, server.address, salt="user-7"),
        kdn_backend(HostPool("layer_first", 8, **{**SMALL, "page_size": 2}),  # type: ignore[arg-type]
                    server.address),
        kdn_backend(pool, server.address, namespace="other"),
    ]
    try:
        mine = base.kdn_key(KEYS[0])
        assert len({mine, *(o.kdn_key(KEYS[0]) for o in others)}) == len(others) + 1
        assert base.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]
        assert [o.batch_exists(KEYS[:2]) for o in others] == [0] * len(others)
        # two TP ranks keep their own shard of one page key
        r1 = others[1]
        assert r1.batch_set_v1(KEYS[:1], pool.indices([3])) == [True]
        assert base.batch_get_v1(KEYS[:1], pool.indices([6])) == [True]
        assert r1.batch_get_v1(KEYS[:1], pool.indices([7])) == [True]
        assert torch.equal(pool.kv_of(6), pool.kv_of(0))
        assert torch.equal(pool.kv_of(7), pool.kv_of(3))
    finally:
        for b in (base, *others):
            b.close()


def test_int8_pages_and_stats(server: ServerThread) -> None:
    pool = HostPool("page_first", 8, seed=5, layers=2, heads=2, head_dim=64, page_size=16)
    b = kdn_backend(pool, server.address, mode="int8")
    try:
        assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]
        assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]  # skipped
        assert b.batch_get_v1(KEYS[:3], pool.indices([4, 5, 6])) == [True, True, False]
        err = (pool.kv_of(4).float() - pool.kv_of(0).float()).abs().max().item()
        assert 0 < err < 0.05  # int8: close, not exact
        s = b.get_stats()  # SGLang's StorageMetrics needs torchvision here: kdn's counters
        page = b.page_bytes
        assert (s.hits, s.misses, s.pages_written, s.pages_skipped) == (2, 1, 2, 2)
        assert s.bytes_read == 2 * page and s.bytes_written == 2 * page
        assert s.stored_bytes <= 0.55 * 2 * page
    finally:
        b.close()


def test_pages_are_keyed_by_codec(server: ServerThread) -> None:
    """An engine storing ``int8`` pages and one storing ``lossless`` pages of the same model
    keep apart: the lossless one neither reads the lossy pages as hits nor skips its own."""
    lossy_pool = HostPool("layer_first", 8, seed=7, **SMALL)  # type: ignore[arg-type]
    exact_pool = HostPool("layer_first", 8, seed=7, **SMALL)  # type: ignore[arg-type]
    lossy = kdn_backend(lossy_pool, server.address, mode="int8")
    exact = kdn_backend(exact_pool, server.address, mode="lossless")
    try:
        assert lossy.batch_set_v1(KEYS[:2], lossy_pool.indices([0, 1])) == [True, True]
        assert exact.batch_exists(KEYS[:2]) == 0
        assert exact.batch_get_v1(KEYS[:2], exact_pool.indices([4, 5])) == [False, False]
        assert exact.batch_set_v1(KEYS[:2], exact_pool.indices([0, 1])) == [True, True]
        assert exact.stats().pages_written == 2
        assert exact.batch_get_v1(KEYS[:2], exact_pool.indices([4, 5])) == [True, True]
        assert torch.equal(exact_pool.kv_of(4), exact_pool.kv_of(0))  # bit-exact
        assert lossy.batch_get_v1(KEYS[:2], lossy_pool.indices([4, 5])) == [True, True]
        # lossless pages keep the plain page key: pages stored before keys named the codec
        # are still read
        assert exact.kdn_key(KEYS[0]) == page_key(
            KEYS[0], exact.layout, "sglang", page_tokens=SMALL["page_size"])
    finally:
        lossy.close()
        exact.close()


def test_the_default_stores_pages_raw(server: ServerThread) -> None:
    """With no mode configured, pages are stored as ``raw`` (bit-exact, no decode on a read:
    ``bench.sglang``'s first read of ``lossless`` pages ran ~11x slower than of ``raw``): the
    server holds each page at its own size plus the container's framing."""
    pool = HostPool("layer_first", 8, seed=9, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address)
    try:
        assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]
        assert b.batch_get_v1(KEYS[:2], pool.indices([4, 5])) == [True, True]
        assert torch.equal(pool.kv_of(4), pool.kv_of(0))
        with Client(server.address) as c:
            got = c.fetch(b.kdn_key(KEYS[0]), namespace="sglang")
        assert got is not None and got.parsed().mode == "raw"
    finally:
        b.close()


def test_a_page_of_another_shape_fails_alone_and_is_stored_again(server: ServerThread
                                                                 ) -> None:
    """An entry of another shape under one page key (another writer's, a damaged one) is a
    miss for that page only: the batch's other pages are read, the prefix ends there, and the
    next write of the page replaces it."""
    pool = HostPool("layer_first", 16, seed=8, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address)
    try:
        assert b.batch_set_v1(KEYS, pool.indices(range(8))) == [True] * 8
        with Client(server.address) as c:
            c.store(b.kdn_key(KEYS[5]), random_kv(uniform_layout(layers=2, dim=8), 4),
                    namespace="sglang")
        assert b.batch_get_v1(KEYS, pool.indices(range(8, 16))) == [True] * 5 + [False] + [True] * 2
        for j in (0, 4, 6, 7):
            assert torch.equal(pool.kv_of(8 + j), pool.kv_of(j))
        assert b.batch_exists(KEYS) == 5 and b.exists(KEYS[5]) is False
        assert b.batch_set_v1(KEYS[5:6], pool.indices([5])) == [True]  # stored again
        assert b.stats().pages_written == 9
        assert b.batch_exists(KEYS) == 8
        assert b.batch_get_v1(KEYS[5:6], pool.indices([13])) == [True]
        assert torch.equal(pool.kv_of(13), pool.kv_of(5))
    finally:
        b.close()


def test_a_wrong_read_target_is_that_calls_miss_only(server: ServerThread) -> None:
    """A target of the wrong size, or fewer targets than keys, fails that read alone (Nones,
    one per key): the stored pages stay present for every caller and read back."""
    pool = HostPool("layer_first", 16, seed=9, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address)
    try:
        assert b.batch_set_v1(KEYS[:4], pool.indices(range(4))) == [True] * 4
        assert b.batch_get([KEYS[1]], [torch.zeros(7, dtype=torch.float16)]) == [None]
        assert b.batch_get(KEYS[:3], [pool.get_dummy_flat_data_page()]) == [None] * 3
        assert b.batch_exists(KEYS[:4]) == 4 and b.exists(KEYS[1]) is True
        assert b.batch_get_v1(KEYS[:4], pool.indices(range(8, 12))) == [True] * 4
        assert torch.equal(pool.kv_of(9), pool.kv_of(1))
    finally:
        b.close()


def test_clear_keeps_other_salts_and_adapters_pages(server: ServerThread) -> None:
    """Engines with another salt or adapter never share pages, so one's ``clear`` leaves the
    others' pages; the scope in the stored model name names neither the salt nor the model
    any less (``ls --model`` by name still finds the pages)."""
    pool = HostPool("layer_first", 8, seed=9, **SMALL)  # type: ignore[arg-type]
    plain = kdn_backend(pool, server.address)
    salted = kdn_backend(pool, server.address, salt="tenant-a")
    adapted = kdn_backend(pool, server.address, salt="tenant-b", adapter="lora-7")
    engines = (plain, salted, adapted)
    try:
        for e in engines:
            assert e.batch_set_v1(KEYS[:3], pool.indices([0, 1, 2])) == [True] * 3
        assert salted.clear() is True
        assert [e.batch_exists(KEYS[:3]) for e in engines] == [3, 0, 3]
        assert plain.clear() is True
        assert [e.batch_exists(KEYS[:3]) for e in engines] == [0, 0, 3]
        with AdminClient(server.address) as admin:
            names = {e.model_name for e in admin.ls("sglang", model="SmolLM2-135M")}
        assert len(names) == 1 and "tenant-b" not in names.pop()
        assert adapted.clear() is True
        assert adapted.batch_exists(KEYS[:3]) == 0
    finally:
        for e in engines:
            e.close()


def test_keys_that_are_not_text_or_bytes_are_misses(server: ServerThread) -> None:
    """A page key ``page_key`` refuses (not str or bytes, not UTF-8, empty) is a miss in every
    call, counted as an error, and never raises into SGLang; an int is not taken as that many
    zero bytes (``bytes(3)``), nor does a large one allocate them."""
    pool = HostPool("layer_first", 8, seed=10, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address)
    try:
        assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]
        for bad in ("", "\ud800abc", None, 3, 2**31):
            assert b.batch_exists([bad]) == 0 and b.exists(bad) is False
            assert b.batch_exists([KEYS[0], bad, KEYS[1]]) == 1  # the prefix ends there
            assert b.batch_get_v1([bad], pool.indices([4])) == [False]
            assert b.batch_set_v1([bad], pool.indices([2])) == [False]
            assert b.get(bad) is None
        assert b.batch_set_v1(["\0\0\0"], pool.indices([3])) == [True]
        assert b.batch_exists([3]) == 0  # not the page of "\0\0\0"
        with pytest.raises(InvalidArgument, match="str or bytes"):
            b.kdn_key(3)  # type: ignore[arg-type]
        assert b.stats().errors >= 5 * 5
    finally:
        b.close()


def test_config_and_refusals(server: ServerThread) -> None:
    pool = HostPool("layer_first", 4, **SMALL)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown kdn backend settings"):
        kdn_backend(pool, server.address, compression="max")
    with pytest.raises(Exception, match="mode"):
        kdn_backend(pool, server.address, mode="nope")
    with pytest.raises(NotImplementedError, match="MLA"):
        from bench.sglang import kdn_extra, storage_config

        cfg = storage_config(extra=kdn_extra(server.address))
        cfg.is_mla_model = True
        KDNHiCacheStorage(cfg)
    b = kdn_backend(pool, server.address)
    try:  # wrong index counts fail the call's pages, they do not raise into SGLang
        assert b.batch_get_v1(KEYS[:2], pool.indices([0])) == [False, False]
        assert b.batch_set_v1(KEYS[:2], pool.indices([0])) == [False, False]
    finally:
        b.close()


@pytest.mark.parametrize("name,value,says", [
    ("insecure", "false", "true or false"), ("insecure", 1, "true or false"),
    ("shm_bytes", "1GiB", "a whole number"), ("local_bytes", -5, ">= 0"),
    ("timeout_s", float("nan"), "a finite number"), ("timeout_s", float("inf"), "a finite number"),
    ("workers", "4", "a whole number"), ("workers", 0, ">= 1"), ("ttl_s", 1.5, "a whole number"),
    ("address", 50051, "a string"), ("mode", ["int8"], "a string"), ("salt", None, "a string"),
    ("timeout_s", 1e10, "at most 86400"), ("shm_bytes", 2**63, "at most 9223372036854775807"),
])
def test_settings_are_checked_by_type_naming_the_field(name: str, value: Any, says: str) -> None:
    """The settings come from JSON: a string ``"false"`` for ``insecure`` turned the
    plaintext API-key guard off, ``workers: "4"`` was a bare TypeError, NaN a timeout."""
    with pytest.raises(ConfigError, match=f"^kdn.{name} must be {re.escape(says)}, got "):
        KDNBackendConfig.from_extra({"kdn": {name: value}})


def test_settings_that_are_not_an_object_or_are_past_any_range_are_named() -> None:
    """``"kdn": "host:port"`` was a bare ValueError, ``[["workers", 2]]`` taken as an object,
    ``"kdn": ""`` (or 0, false, []) the defaults, and ``workers: 10**400`` an OverflowError
    traceback."""
    for got in ("127.0.0.1:50051", [["workers", 2]], 7, "", [], 0, False, None):
        with pytest.raises(ConfigError, match="kdn: the backend's settings are a JSON object"):
            KDNBackendConfig.from_extra({"kdn": got})  # (falsy ones were the defaults)
    for extra in ("kdn", [1], 5):  # (an AttributeError)
        with pytest.raises(ConfigError, match="the backend's extra config is a JSON object"):
            KDNBackendConfig.from_extra(extra)  # type: ignore[arg-type]
    assert KDNBackendConfig.from_extra({"other": 1}) == KDNBackendConfig.from_extra(None)
    for name in ("workers", "shm_bytes", "ttl_s", "timeout_s"):
        with pytest.raises(ConfigError, match=f"kdn.{name} must be a"):
            KDNBackendConfig.from_extra({"kdn": {name: 10**400}})


def test_a_string_insecure_does_not_send_the_api_key_in_plaintext() -> None:
    from bench.sglang import kdn_extra, storage_config

    far = kdn_extra("10.1.2.3:50051", api_key="secret", timeout_s=1.0)
    with pytest.raises(ConfigError, match="kdn.insecure must be true or false"):
        KDNHiCacheStorage(storage_config(extra={**far, "kdn": {**far["kdn"], "insecure": "false"}}))
    with pytest.raises(InvalidArgument, match="refusing to send an API key in plaintext"):
        KDNHiCacheStorage(storage_config(extra=far))


def test_tls_files_turn_tls_on_and_must_exist(server: ServerThread, tmp_path: Path) -> None:
    """tls_cert/tls_key without tls_ca meant no TLS at all (the pages and the API key went in
    plaintext): any of the three turns TLS on, trusting the system's roots without tls_ca, as
    ``kdn admin``'s flags do; a file that is not there is refused when the backend is built."""
    certs = make_certs(tmp_path)
    cfg = KDNBackendConfig(tls_cert=str(certs["client.crt"]), tls_key=str(certs["client.key"]))
    tls = cfg.tls()
    assert tls is not None and tls.ca is None and tls.cert == certs["client.crt"].read_bytes()
    pool = HostPool("layer_first", 4, seed=2, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, server.address, timeout_s=5.0, tls_cert=str(certs["client.crt"]),
                    tls_key=str(certs["client.key"]))
    try:  # the plaintext server is not reached over TLS: nothing stored, nothing read
        assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [False, False]
        assert b.stats().errors >= 1
    finally:
        b.close()
    with Client(server.address) as c:
        assert c.stats().tiers[0].entries == 0
    for extra, says in (({"tls_ca": str(tmp_path / "none.crt")}, "kdn.tls_ca: no such file"),
                        ({"tls_cert": str(certs["client.crt"])}, "kdn.tls_cert and kdn.tls_key"),
                        ({"tls_cert": str(certs["client.crt"]), "tls_key": str(tmp_path / "k")},
                         "kdn.tls_key: no such file")):
        with pytest.raises(ConfigError, match=re.escape(says)):
            KDNBackendConfig.from_extra({"kdn": extra})


def test_an_empty_level_is_the_modes_default(server: ServerThread) -> None:
    """``level: ""`` is documented as the mode's own level: for ``kdn`` that is ``default``
    (``KDNBackendConfig(mode="kdn")`` raised "codec mode 'kdn' has no level ''")."""
    assert KDNBackendConfig(mode="kdn").level == "default"
    assert KDNBackendConfig(mode="int8").level == ""
    pool = HostPool("layer_first", 8, seed=3, **SMALL)  # type: ignore[arg-type]
    plain, named = kdn_backend(pool, server.address, mode="kdn"), \
        kdn_backend(pool, server.address, mode="kdn", level="default")
    try:
        assert plain.kdn_key(KEYS[0]) == named.kdn_key(KEYS[0])
        assert plain.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [True, True]
        assert named.batch_get_v1(KEYS[:2], pool.indices([4, 5])) == [True, True]
        want = pool.kv_of(0).float()
        err = (pool.kv_of(4).float() - want).abs().max().item()
        assert 0 < err < 0.5 * want.abs().max().item()  # kdn-default: near, not exact
    finally:
        plain.close()
        named.close()


def test_server_down_is_a_miss_not_an_error(tmp_path: Path) -> None:
    pool = HostPool("layer_first", 4, seed=6, **SMALL)  # type: ignore[arg-type]
    b = kdn_backend(pool, "127.0.0.1:1", timeout_s=2.0)  # nothing listens there
    try:
        assert b.batch_exists(KEYS[:2]) == 0
        assert b.batch_get_v1(KEYS[:2], pool.indices([0, 1])) == [False, False]
        assert b.batch_set_v1(KEYS[:2], pool.indices([0, 1])) == [False, False]
        assert b.stats().errors >= 3
    finally:
        b.close()


def test_the_backend_configures_in_a_fresh_process() -> None:
    """SGLang imports the backend in its own process: nothing may rely on a kdn module some
    other import happened to load first (``codec.modes`` did)."""
    import subprocess
    import sys

    code = ("from kdn.integrations.sglang import KDNBackendConfig\n"
            "c = KDNBackendConfig.from_extra({'kdn': {'mode': 'kdn', 'level': 'small'}})\n"
            "assert (c.mode, c.level) == ('kdn', 'small')\n"
            "try:\n    KDNBackendConfig.from_extra({'kdn': {'mode': 'kdn', 'level': 'l2'}})\n"
            "except Exception as e:\n    print(type(e).__name__, e)\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr[-2000:]
    assert "has no level 'l2'" in run.stdout
