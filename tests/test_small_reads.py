"""Small entries read alone on the server's host come inside the GetMany answer
(``GetManyRequest.inline_below_bytes``, ``kdn.client.dataplane.SMALL_ENTRY_BYTES``): no arena
lease, checked by the server on the bytes it sends, and ``retrieve`` builds the CPU cache in one
step (``kdn.client.landing.direct_kv``). Larger entries and batches are leased as before; a
damaged server copy is read again, an answer that does not add up raises Corrupt; the layout
asked for is still checked."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kdn.cache import KVCache
from kdn.client import Client, dataplane
from kdn.client.samehost import SameHostPath
from kdn.errors import Corrupt, LayoutMismatch
from kdn.server import ServerThread
from kdn.v1 import kdn_pb2 as pb
from tests.helpers import numbered_key as _key
from tests.helpers import random_kv, uniform_layout, without_directory

LAYOUT = uniform_layout()  # 512 bytes a token


@pytest.fixture(autouse=True)
def _not_listed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reads as they go for an entry the read arena's directory does not list
    (``tests/test_directory.py`` covers listed ones)."""
    without_directory(monkeypatch)



def _counters(c: Client) -> dict[str, int]:
    return dict(c.stats().counters)


def test_a_small_entry_read_alone_comes_in_the_answer(server: ServerThread,
                                                      shm_client: Client) -> None:
    small, large = random_kv(LAYOUT, 8, seed=1, start=5), random_kv(LAYOUT, 200, seed=2)
    shm_client.store(_key(1), small, mode="raw")
    shm_client.store(_key(2), large, mode="raw")  # 100 KiB: over SMALL_ENTRY_BYTES
    assert server.server is not None
    arenas = server.server.servicer.arenas
    fills = arenas.counters().get("arena.fills", 0)
    got = shm_client.fetch(_key(1), layout=LAYOUT)
    assert got is not None and got.checked and not got.owned  # the server's checked copy
    back = shm_client.retrieve(_key(1), layout=LAYOUT)
    assert back is not None and back.equal(small) and back.start_position == 5
    back.layers[0][0].zero_()  # the caller's own memory: the next read is not affected
    again = shm_client.retrieve(_key(1), layout=LAYOUT)
    assert again is not None and again.equal(small)
    arena = shm_client.dataplane.same_host.arena
    assert arena is not None and arena.kept_bytes == 0  # nothing leased for the small one
    assert arenas.counters().get("arena.fills", 0) == fills  # nor copied into the arena
    big = shm_client.retrieve(_key(2), layout=LAYOUT)
    assert big is not None and big.equal(large)
    leased = shm_client.fetch(_key(2), layout=LAYOUT)
    assert leased is not None and leased.owned  # a view of the read arena
    del leased, big
    assert shm_client.retrieve(_key(3), layout=LAYOUT) is None  # a miss
    with pytest.raises(LayoutMismatch):
        shm_client.retrieve(_key(1), layout=uniform_layout(layers=3))


def test_a_batch_of_small_entries_is_not_inlined(shm_client: Client,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    kvs = [random_kv(LAYOUT, 8, seed=10 + i) for i in range(4)]
    shm_client.store_many([(_key(10 + i), kv) for i, kv in enumerate(kvs)], mode="raw")
    asked: list[int] = []
    real = SameHostPath.call

    def spy(self: SameHostPath, op: int, req: pb.GetManyRequest | pb.PutManyRequest
            ) -> bytes | None:
        if isinstance(req, pb.GetManyRequest):
            asked.append(req.inline_below_bytes)
        return real(self, op, req)

    monkeypatch.setattr(SameHostPath, "call", spy)
    got = shm_client.retrieve_many([_key(10 + i) for i in range(4)], layout=LAYOUT)
    assert all(g is not None and g.equal(kv) for g, kv in zip(got, kvs))
    assert asked == [0]  # one GetMany, its entries leased
    again = shm_client.retrieve(_key(10), layout=LAYOUT)  # from the lease the batch kept
    assert again is not None and again.equal(kvs[0]) and len(asked) == 1
    lone = random_kv(LAYOUT, 8, seed=19)
    shm_client.store(_key(19), lone, mode="raw")
    one = shm_client.retrieve(_key(19), layout=LAYOUT)  # alone: asked inline
    assert one is not None and one.equal(lone)
    assert asked[-1] == dataplane.SMALL_ENTRY_BYTES


def _answers_changed(real: Callable[..., bytes | None],
                     change: Callable[[pb.GetManyResponse], None]) -> Callable[..., bytes | None]:
    """``SameHostPath.call`` whose GetMany answers ``change`` alters before the client reads
    them."""
    def call(self: SameHostPath, op: int, req: pb.GetManyRequest | pb.PutManyRequest
             ) -> bytes | None:
        body = real(self, op, req)
        if not isinstance(req, pb.GetManyRequest) or body is None:
            return body
        resp = pb.GetManyResponse.FromString(body)
        change(resp)
        return resp.SerializeToString()
    return call


def test_inline_answers_that_do_not_add_up_raise_corrupt(shm_client: Client,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    kv = random_kv(LAYOUT, 8, seed=3)
    shm_client.store(_key(4), kv, mode="raw")
    real = SameHostPath.call

    def short(resp: pb.GetManyResponse) -> None:
        resp.entries[0].data = resp.entries[0].data[:-1]  # a byte short of its length

    monkeypatch.setattr(SameHostPath, "call", _answers_changed(real, short))
    with pytest.raises(Corrupt, match="inline"):
        shm_client.retrieve(_key(4), layout=LAYOUT)

    def two(resp: pb.GetManyResponse) -> None:
        resp.entries.add().CopyFrom(resp.entries[0])  # an answer for a key not asked for

    monkeypatch.setattr(SameHostPath, "call", _answers_changed(real, two))
    with pytest.raises(Corrupt, match="2 entries for 1 key"):
        shm_client.fetch(_key(4), layout=LAYOUT)


def test_a_damaged_small_value_is_read_again_or_missed(server: ServerThread,
                                                      shm_client: Client) -> None:
    kv = random_kv(LAYOUT, 8, seed=4)
    shm_client.store(_key(5), kv, mode="raw")
    assert server.server is not None
    ram = next(t for t in server.server.store.tiers if t.name == "ram")
    skey = next(k for k in ram._data if k.endswith(_key(5).hex().encode()))  # noqa: SLF001
    bad = bytearray(ram._data[skey])  # noqa: SLF001
    bad[-10] ^= 0x01  # a flipped bit in a value checked when it was stored
    ram._data[skey] = bytes(bad)  # noqa: SLF001
    back = shm_client.retrieve(_key(5), layout=LAYOUT)
    assert back is not None and back.equal(kv)  # the disk copy, read again and checked
    assert _counters(shm_client)["getmany.corrupt"] == 1
    ram._data[skey] = bytes(bad)  # noqa: SLF001  # and with no sound copy left anywhere:
    for tier in server.server.store.tiers:
        if tier.name != "ram":
            tier.delete(skey)
    assert shm_client.retrieve(_key(5), layout=LAYOUT) is None  # a miss, not damaged tensors


def test_a_value_read_again_after_damage_keeps_the_shape_asked_for(
        server: ServerThread, shm_client: Client) -> None:
    """The read that replaces a damaged copy is served only with the layout and tokens the
    first one was checked to have: a disk copy of another shape (written meanwhile) is a
    miss, not an entry the reader said it does not want."""
    from kdn import codec

    shm_client.store(_key(7), random_kv(LAYOUT, 8, seed=7), mode="raw")
    assert server.server is not None
    tiers = {t.name: t for t in server.server.store.tiers}
    skey = next(k for k in tiers["ram"]._data if k.endswith(_key(7).hex().encode()))  # noqa: SLF001
    bad = bytearray(tiers["ram"]._data[skey])  # noqa: SLF001
    bad[-10] ^= 0x01
    tiers["ram"]._data[skey] = bytes(bad)  # noqa: SLF001
    tiers["disk"].put(skey, codec.encode_parts(random_kv(LAYOUT, 9, seed=8), "raw").to_bytes())
    assert shm_client.retrieve(_key(7), layout=LAYOUT, tokens=8) is None


def test_direct_kv_views_have_the_layout_shapes(shm_client: Client) -> None:
    layout = uniform_layout(layers=3, heads=2, dim=8)
    kv = random_kv(layout, 5, seed=6, start=40)
    shm_client.store(_key(6), kv, mode="raw")
    back = shm_client.retrieve(_key(6), layout=layout)
    assert isinstance(back, KVCache) and back.equal(kv)
    back.validate()  # made without validation: its shapes are the layout's all the same
    for (k, v), lay in zip(back.layers, layout.layers):
        assert k.shape == (lay.kv_heads, 5, lay.k_channels) and k.dtype == torch.float16
        assert v.shape == (lay.kv_heads, 5, lay.v_channels)
