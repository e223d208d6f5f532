"""A batch of stores is checked whole before any of it is stored, on every path a client
writes by (the shared segment, the network data path, gRPC alone): a bad argument, an entry
the server refuses, or a damaged one leaves nothing of the batch stored, and the error names
the caller's item."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from kdn import codec
from kdn.client import Client
from kdn.codec import EncodedParts
from kdn.errors import InvalidArgument, TooLarge
from kdn.server import ServerConfig, ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()

PATHS = [{}, {"shm_bytes": 0}, {"shm_bytes": 0, "data_path": False}]
"""Through the shared segment (same host), the network data path, gRPC alone."""


@pytest.mark.parametrize("options", PATHS)
def test_a_bad_mode_stores_nothing_of_the_batch(server: ServerThread,
                                                options: dict[str, Any]) -> None:
    """A mistyped mode or level was found only when the batch's first KVCache was encoded,
    after its staged items had been stored."""
    a, b = numbered_key(1), numbered_key(2)
    with Client(server.address, timeout_s=30, **options) as c:
        st = c.stage(LAYOUT, 8)
        st.write(random_kv(LAYOUT, 8, seed=1))
        kv = random_kv(LAYOUT, 8, seed=2)
        for mode, level, match in (("lossy", "", "unknown codec mode 'lossy'"),
                                   ("kdn", "smal", "has no level 'smal'"),
                                   ("raw", "x", "has no level 'x'")):
            with pytest.raises(InvalidArgument, match=match):
                c.store_many([(a, st), (b, kv)], mode=mode, level=level)
            with pytest.raises(InvalidArgument, match=match):
                c.store(a, st, mode=mode, level=level)
            with pytest.raises(InvalidArgument, match=match):
                c.store_async(a, st, mode=mode, level=level).result()
        with pytest.raises(InvalidArgument, match="layers_per_frame"):
            c.store_many([(a, st), (b, kv)], layers_per_frame=-1)
        c.flush()
        assert [i.present for i in c.lookup([a, b]).infos] == [False, False]
        st.close()


@pytest.mark.parametrize("options", PATHS)
def test_a_mode_alone_stores_with_its_default_level(server: ServerThread,
                                                   options: dict[str, Any]) -> None:
    """mode="kdn" without a level was refused ("has no level ''"), though the catalog says
    kdn alone means kdn-default; each store is encoded at that level now."""
    a, b, c3 = numbered_key(3), numbered_key(4), numbered_key(5)
    kv = random_kv(LAYOUT, 8, seed=3)
    want = codec.decode(codec.encode(kv, "kdn", "default"))
    with Client(server.address, timeout_s=30, **options) as c:
        c.store(a, kv, mode="kdn")
        c.store_many([(b, kv)], mode="kdn")
        c.store_async(c3, kv, mode="kdn").result()
        c.flush()
        for key in (a, b, c3):
            got = c.retrieve(key)
            assert got is not None and got.equal(want)
        assert codec.encode(kv, "kdn") == codec.encode(kv, "kdn", "default")


@pytest.mark.parametrize("options", PATHS)
def test_an_entry_the_codec_refuses_stores_nothing_of_the_batch(
        server: ServerThread, options: dict[str, Any]) -> None:
    """A KVCache the codec refuses (a NaN under a lossy mode) was found only after the
    batch's staged items had been stored."""
    a, b = numbered_key(1), numbered_key(2)
    with Client(server.address, timeout_s=30, **options) as c:
        st = c.stage(LAYOUT, 8)
        st.write(random_kv(LAYOUT, 8, seed=1))
        kv = random_kv(LAYOUT, 8, seed=2)
        kv.layers[0][0][0, 0, 0] = float("nan")
        with pytest.raises(InvalidArgument, match="NaN"):
            c.store_many([(a, st), (b, kv)], mode="int8")
        c.flush()
        assert [i.present for i in c.lookup([a, b]).infos] == [False, False]
        st.close()


@pytest.mark.parametrize("options", PATHS)
def test_a_damaged_entry_stores_nothing_of_a_batch_of_several_calls(
        server: ServerThread, options: dict[str, Any]) -> None:
    """50 entries of ~390 KB, the last with a damaged frame: the batch goes in several calls
    through the segment and over gRPC, and the calls before the last were stored (42 and 43
    of 50), the error naming the item by its index in its call ("item 7")."""
    good = codec.encode_parts(random_kv(uniform_layout(layers=4, heads=2, dim=64), 190,
                                        seed=1), "raw")
    frame = bytearray(good.frames[-1])
    frame[-5] ^= 0xFF
    bad = EncodedParts(good.header, [*good.frames[:-1], bytes(frame)])
    keys = [numbered_key(i) for i in range(50)]
    items: list[tuple[bytes, Any]] = [(k, good) for k in keys[:-1]] + [(keys[-1], bad)]
    with Client(server.address, timeout_s=30, **options) as c:
        with pytest.raises(InvalidArgument, match=r"item 49: corrupt input: frame \d+: checksum"):
            c.store_many(items)
        assert not any(i.present for i in c.lookup(keys).infos)
        short = EncodedParts(good.header, [])
        with pytest.raises(InvalidArgument, match="item 1: corrupt input: 0 frames"):
            c.store_many([(keys[0], good), (keys[1], short)])
        assert not any(i.present for i in c.lookup(keys).infos)
        c.store_many(items[:-1])
        assert all(i.present for i in c.lookup(keys[:-1]).infos)


@pytest.mark.parametrize("options", PATHS)
def test_an_entry_the_server_refuses_stores_nothing_of_the_batch(
        server_config: ServerConfig, options: dict[str, Any]) -> None:
    """An entry over the server's max_entry_bytes between two small ones: over gRPC the small
    ones went by PutMany and the large one was stored on its own after them, so the refusal
    left them stored (through the segment, none)."""
    layout = uniform_layout(layers=4, heads=2, dim=64)
    small, big = random_kv(layout, 16, seed=1), random_kv(layout, 2600, seed=2)  # big: 5.3 MB
    keys = [numbered_key(i) for i in range(3)]
    config = dataclasses.replace(server_config, max_entry_bytes=3 << 20)
    with ServerThread(config) as server, \
            Client(server.address, timeout_s=30, **options) as c:
        with pytest.raises(TooLarge):
            c.store_many(list(zip(keys, [small, big, small])), mode="raw")
        assert not any(i.present for i in c.lookup(keys).infos)


def test_a_small_message_limit_still_sends_a_batch_inline(server: ServerThread) -> None:
    """A client of max_message_bytes 1 MiB kept 1 byte of it for entries: each entry of a
    batch was stored on its own."""
    kvs = [random_kv(LAYOUT, 8, seed=i) for i in range(4)]
    keys = [numbered_key(i) for i in range(4)]
    with Client(server.address, timeout_s=30, shm_bytes=0, data_path=False,
                max_message_bytes=1 << 20) as c:
        assert c.dataplane.put_inline_most >= 512 << 10
        c.store_many(list(zip(keys, kvs)))
        assert all(got is not None and got.equal(kv)
                   for got, kv in zip(c.retrieve_many(keys), kvs))


def test_the_data_path_stays_after_the_server_refuses_an_entry(
        server_config: ServerConfig, caplog: pytest.LogCaptureFixture) -> None:
    """The server answers an entry over its max_entry_bytes and closes the connection while
    the rest comes: the client, still sending, read ECONNRESET as a dead path and went by
    gRPC for every later call."""
    layout = uniform_layout(layers=4, heads=2, dim=64)
    small, big = random_kv(layout, 16, seed=1), random_kv(layout, 2600, seed=2)
    keys = [numbered_key(i) for i in range(4)]
    config = dataclasses.replace(server_config, max_entry_bytes=3 << 20)
    with ServerThread(config) as server, \
            Client(server.address, timeout_s=30, shm_bytes=0) as c:
        c.store_many([(keys[0], small), (keys[1], small)], mode="raw")
        assert c.dataplane.direct
        with pytest.raises(TooLarge, match="max_entry_bytes"):
            c.store_many([(keys[2], small), (keys[3], big)], mode="raw")
        assert c.dataplane.direct and "unusable" not in caplog.text
        assert [i.present for i in c.lookup(keys).infos] == [True, True, False, False]
