"""What a Client refuses, against a real server: each bad argument is a kdn error naming it
(InvalidArgument), raised where every call passes, not an AttributeError, a ValueError or a
TypeError from protobuf, gRPC or torch; and what it takes (None and inf: no deadline)."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client import AsyncClient, Client
from kdn.codec import EncodedParts
from kdn.errors import Closed, InvalidArgument
from kdn.options import MAX_TTL_S, Durability, StoreOptions
from kdn.server import ServerThread
from tests.helpers import numbered_key, random_kv, uniform_layout

LAYOUT = uniform_layout()


def test_a_timeout_is_a_number_of_seconds_or_none(server: ServerThread) -> None:
    """0, -1 and NaN were taken and every call then failed DEADLINE_EXCEEDED at once, as did
    inf and 1e12 (no deadline gRPC can hold); "5" failed inside gRPC (TypeError)."""
    for bad in (0, -1, math.nan, "5", True):
        with pytest.raises(InvalidArgument, match="timeout_s"):
            Client(server.address, timeout_s=bad)  # type: ignore[arg-type]
    kv = random_kv(LAYOUT, 8, seed=1)
    for none in (None, math.inf, 1e12):
        with Client(server.address, timeout_s=none) as c:
            assert c.timeout_s is None
            c.store(numbered_key(1), kv)
            assert c.retrieve(numbered_key(1)).equal(kv)  # type: ignore[union-attr]
            assert c.lookup([numbered_key(1)]).infos[0].present
            c.stats()
    with Client(server.address, timeout_s=5) as c:
        assert c.timeout_s == 5.0


def test_a_per_call_timeout_is_checked_as_the_clients(server: ServerThread) -> None:
    """``lookup(timeout_s=...)`` took 0, -1 and NaN (DeadlineExceeded at once) and "abc" (a raw
    TypeError); inf is no deadline."""
    with Client(server.address, timeout_s=30) as c:
        for bad in (0, -1, math.nan, "abc", True):
            with pytest.raises(InvalidArgument, match="timeout_s"):
                c.lookup([numbered_key(1)], timeout_s=bad)  # type: ignore[arg-type]
        for good in (5, 0.5, math.inf):
            assert not c.lookup([numbered_key(1)], timeout_s=good).infos[0].present


CLIENTS = [{}, {"shm_bytes": 0}, {"shm_bytes": 0, "data_path": False},
           {"local_bytes": 1 << 20}]
"""The ways a client reads and writes: through the shared segment (same host), the network
data path, gRPC alone, and with an in-process tier in front."""


@pytest.mark.parametrize("options", CLIENTS)
def test_what_is_not_a_kv_cache_is_refused_by_name(server: ServerThread,
                                                   options: dict[str, Any]) -> None:
    """``store(key, None)`` was an AttributeError from inside the codec (also store_many,
    store_async, and raw stores written straight into the segment)."""
    with Client(server.address, timeout_s=30, **options) as c:
        for bad in (None, torch.zeros(3)):
            what = type(bad).__name__
            for mode in ("lossless", "raw", "kdn"):
                level = "default" if mode == "kdn" else ""
                with pytest.raises(InvalidArgument, match=f"expected a KVCache.* got {what}"):
                    c.store(numbered_key(1), bad, mode=mode, level=level)  # type: ignore[arg-type]
                with pytest.raises(InvalidArgument, match=f"expected a KVCache.* got {what}"):
                    c.store_many([(numbered_key(2), random_kv(LAYOUT, 4)),  # none is stored
                                  (numbered_key(1), bad)], mode=mode, level=level)  # type: ignore[list-item]
                with pytest.raises(InvalidArgument, match=f"expected a KVCache.* got {what}"):
                    c.store_async(numbered_key(1), bad, mode=mode, level=level)  # type: ignore[arg-type]
        assert not any(i.present for i in c.lookup([numbered_key(1), numbered_key(2)]).infos)
    kv = random_kv(LAYOUT, 4)
    meta = KVCache(LAYOUT, [(k.to("meta"), v.to("meta")) for k, v in kv.layers])
    with pytest.raises(InvalidArgument, match="meta device"):
        codec.encode(meta)
    with pytest.raises(InvalidArgument, match="expected a KVCache, got NoneType"):
        codec.encode(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("options", CLIENTS)
def test_encoded_parts_of_the_wrong_kind_are_refused_by_name(server: ServerThread,
                                                              options: dict[str, Any]) -> None:
    """EncodedParts of str frames, or of None, were a raw TypeError from deep in each path
    (over gRPC alone "UNKNOWN: Exception iterating requests!"), and a header that is not a
    kdn container was that UNKNOWN KDNError over gRPC alone (InvalidArgument elsewhere)."""
    good = codec.encode_parts(random_kv(LAYOUT, 8, seed=3), "raw")
    bad = [(EncodedParts(good.header, ["x"] * len(good.frames)), "frame 0 must be bytes, got str"),
           (EncodedParts(None, None), "header must be bytes, got NoneType"),  # type: ignore[arg-type]
           (EncodedParts(good.header, None), "frames must be a list of bytes, got NoneType"),  # type: ignore[arg-type]
           (EncodedParts(b"junk" * 8, good.frames), "corrupt input")]
    with Client(server.address, timeout_s=30, **options) as c:
        for parts, match in bad:
            with pytest.raises(InvalidArgument, match=match):
                c.store(numbered_key(1), parts)
            with pytest.raises(InvalidArgument, match=match):
                c.store_async(numbered_key(1), parts).result()
            with pytest.raises(InvalidArgument, match=match):
                c.store_many([(numbered_key(2), good), (numbered_key(1), parts)])
        assert not any(i.present for i in c.lookup([numbered_key(1), numbered_key(2)]).infos)


@pytest.mark.parametrize("options", CLIENTS)
def test_store_many_takes_key_entry_pairs_each_key_once(server: ServerThread,
                                                       options: dict[str, Any]) -> None:
    """A key given twice in one store_many (which entry would be kept would depend on the
    path), an item that is a dict, a (key, entry, x) triple or a bare KVCache, and
    ``options`` as a dict: each InvalidArgument naming it, before anything is stored."""
    old, a, b = (random_kv(LAYOUT, n, seed=10 + n) for n in (4, 8, 600))
    x, y = numbered_key(20), numbered_key(21)
    with Client(server.address, timeout_s=30, **options) as c:
        c.store(x, old)
        for mode in ("raw", "lossless"):
            with pytest.raises(InvalidArgument, match=f"key {x.hex()} is items 0 and 2 of one "
                               "store_many"):
                c.store_many([(x, a), (y, b), (x, b)], mode=mode)
            for bad, match in (({x: a}, "list of .key, entry. pairs, got dict .a dict: list"),
                               ([(y, a, 1)], "item 0 of store_many must be a .key, entry. "
                                             "pair, got a tuple of 3"),
                               ([(y, a), a], "item 1 .*got KVCache")):
                with pytest.raises(InvalidArgument, match=match):
                    c.store_many(bad, mode=mode)  # type: ignore[arg-type]
            opts: Any = {"ttl_s": 5}
            bad_options = "options must be a kdn.StoreOptions.*got dict"
            with pytest.raises(InvalidArgument, match=bad_options):
                c.store(y, a, mode=mode, options=opts)
            with pytest.raises(InvalidArgument, match=bad_options):
                c.store_many([(y, a)], mode=mode, options=opts)
            with pytest.raises(InvalidArgument, match=bad_options):
                c.store_async(y, a, mode=mode, options=opts).result()
        c.flush()
        assert c.retrieve(x).equal(old)  # type: ignore[union-attr]
        assert c.retrieve(y) is None
        assert [r.stored_bytes > 0 for r in c.store_many(iter([(x, a), (y, b)]))] == [True] * 2
        assert c.retrieve(x).equal(a) and c.retrieve(y).equal(b)  # type: ignore[union-attr]


@pytest.mark.parametrize("options", CLIENTS)
def test_read_arguments_are_refused_by_name(server: ServerThread,
                                            options: dict[str, Any]) -> None:
    """tokens=-1 was a ValueError, a device torch does not know or that is not here a
    RuntimeError from torch, first_layer=-1 a ValueError from protobuf, and a window with no
    layer in it (first_layer=3, last_layer=1) was sent as it was."""
    kv = random_kv(LAYOUT, 8, seed=2)
    k = numbered_key(3)
    with Client(server.address, timeout_s=30, **options) as c:
        c.store(k, kv)
        reads: list[tuple[str, Callable[..., Any]]] = [
            ("retrieve", lambda **kw: c.retrieve(k, **kw)),
            ("retrieve_stream", lambda **kw: c.retrieve_stream(k, **kw)),
            ("retrieve_many", lambda **kw: c.retrieve_many([k, k], **kw)),
            ("retrieve_streams", lambda **kw: [s.result() for s in c.retrieve_streams(
                [k, k], **kw) if s is not None])]
        absent = "cuda:7" if torch.cuda.device_count() <= 7 else "cuda:99"
        for name, read in reads:
            for bad, match in (({"tokens": -1}, "tokens must be"),
                               ({"tokens": 1.5}, "tokens must be"),
                               ({"layout": "test-model"}, "layout must be"),
                               ({"device": "bogus"}, "device 'bogus'"),
                               ({"device": absent}, f"device '{absent}'")):
                with pytest.raises(InvalidArgument, match=match):
                    read(**bad)
            assert read(device="cpu") is not None, name
        for bad, match in (({"first_layer": -1}, "first_layer must be"),
                           ({"last_layer": -2}, "last_layer must be"),
                           ({"first_layer": 3, "last_layer": 1}, r"first_layer \(3\)"),
                           ({"first_layer": 2, "last_layer": 2}, r"first_layer \(2\)")):
            with pytest.raises(InvalidArgument, match=match):
                c.retrieve_stream(k, **bad)
        stream = c.retrieve_stream(k, first_layer=1, last_layer=3)
        assert stream is not None
        assert torch.equal(stream.wait_for_layer(2, 30)[0], kv.layers[2][0])
    with pytest.raises(InvalidArgument, match="device 'bogus'"):
        codec.decode(codec.encode(kv), device="bogus")


@pytest.mark.parametrize("options", CLIENTS)
def test_a_closed_client_refuses_every_call(server: ServerThread,
                                            options: dict[str, Any]) -> None:
    """Calls after close() raised gRPC's ValueError ("Cannot invoke RPC on closed channel"),
    and with an in-process tier its reads were still served from it."""
    kv = random_kv(LAYOUT, 8, seed=3)
    k = numbered_key(4)
    c = Client(server.address, timeout_s=30, **options)
    c.store(k, kv)
    assert c.retrieve(k) is not None
    c.close()
    c.close()  # twice: nothing more
    calls: list[Callable[[], Any]] = [
        lambda: c.store(k, kv), lambda: c.store_many([(k, kv)]),
        lambda: c.store_async(k, kv).result(), lambda: c.retrieve(k),
        lambda: c.retrieve_stream(k), lambda: c.retrieve_many([k]),
        lambda: c.retrieve_streams([k, k]), lambda: c.fetch(k), lambda: c.fetch_many([k]),
        lambda: c.lookup([k]), lambda: c.contains(k), lambda: c.delete(k),
        lambda: c.stats(), lambda: c.health(), c.flush, lambda: c.stage(LAYOUT, 4),
        lambda: c.retrieve_joined([k, k])]  # (these three answered: None, a Staged, None)
    for call in calls:
        with pytest.raises(Closed, match="closed"):
            call()
    if c.local is not None:
        assert c.local.stats.entries == 0  # its memory went with it


def test_client_settings_are_refused_by_name_and_an_empty_namespace_is_the_default(
        server: ServerThread) -> None:
    """An address of None or an int was an AttributeError; local_bytes=-1 was a ValueError,
    1.5 and True were taken as tier sizes; namespace="" (the default, as in a request) was
    refused."""
    for bad in (None, 50051, b"127.0.0.1:50051"):  # an AttributeError (rstrip), a TypeError
        with pytest.raises(InvalidArgument, match="address must be a string"):
            Client(bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgument, match="address must be a string"):
            AsyncClient(bad)  # type: ignore[arg-type]
    for bad in (-1, 1.5, True, "10"):
        with pytest.raises(InvalidArgument, match="local_bytes"):
            Client(server.address, local_bytes=bad)  # type: ignore[arg-type]
    for bad in (-1, 1.5):
        with pytest.raises(InvalidArgument, match="data_connections"):
            Client(server.address, data_connections=bad)  # type: ignore[arg-type]
    for name, bad in (("streams", -2), ("streams", 2.5), ("shm_bytes", -1),
                      ("shm_bytes", "1MiB"), ("keep_leases_bytes", 1.5),
                      ("max_message_bytes", 1000), ("max_message_bytes", 1 << 31),
                      ("max_message_bytes", True), ("shm_bytes", 2**63),
                      ("keep_leases_bytes", 2**64), ("local_bytes", 2**63)):
        with pytest.raises(InvalidArgument, match=name):
            Client(server.address, **{name: bad})
    kv = random_kv(LAYOUT, 8, seed=4)
    with Client(server.address, namespace="") as c, Client(server.address) as d:
        assert c.namespace == "default"
        c.store(numbered_key(5), kv)
        assert d.retrieve(numbered_key(5), namespace="default").equal(kv)  # type: ignore[union-attr]


def test_a_clients_switches_are_bools(monkeypatch: pytest.MonkeyPatch) -> None:
    """insecure="false" (a settings file's text) was true: the API key went in plaintext to
    another host; tracing and data_path alike. AsyncClient and AdminClient make a Client."""
    from kdn.client.admin import AdminClient

    for name, bad in (("insecure", "false"), ("insecure", 0), ("tracing", "no"),
                      ("data_path", "0"), ("data_path", None)):
        for make in (Client, AdminClient):
            with pytest.raises(InvalidArgument, match=f"^{name} must be True or False"):
                make("10.1.2.3:50051", api_key="secret", shm_bytes=0, **{name: bad})
    monkeypatch.delenv("KDN_INSECURE", raising=False)
    with pytest.raises(InvalidArgument, match="refusing to send an API key in plaintext"):
        Client("10.1.2.3:50051", api_key="secret", shm_bytes=0, insecure=None)


def test_a_retry_is_checked_when_made() -> None:
    """Retry(retries=-1) made every call raise AssertionError('unreachable'), base_s=-1 a
    ValueError from the pause, a huge cap_s an OverflowError."""
    import grpc

    from kdn import Retry

    for kw, match in (({"retries": -1}, "Retry.retries must be a whole number in 0..1000"),
                      ({"retries": 2.5}, "Retry.retries"), ({"retries": True}, "Retry.retries"),
                      ({"base_s": -1.0}, "Retry.base_s must be a number in 0..86400 seconds"),
                      ({"base_s": float("nan")}, "Retry.base_s"), ({"cap_s": 1e300}, "Retry.cap_s"),
                      ({"codes": ("UNAVAILABLE",)}, "Retry.codes must be grpc.StatusCode")):
        with pytest.raises(InvalidArgument, match=re.escape(match)):
            Retry(**kw)  # type: ignore[arg-type]
    assert Retry(codes=[grpc.StatusCode.UNAVAILABLE]).codes == (grpc.StatusCode.UNAVAILABLE,)
    assert Retry(retries=0, base_s=0, cap_s=0).retries == 0


def test_store_options_take_a_durability_not_a_bool_and_numpy_seconds() -> None:
    """durability=True was Durability.MEMORY (the least durable: a bool is an int), False
    DEFAULT and 2.0 DISK, while "DISK" was refused by a message listing the names; ttl_s
    refused numpy's np.int64(5)."""
    for bad in (True, False, 2.0, 7, "fast", None):
        with pytest.raises(InvalidArgument, match="durability must be a kdn.Durability or one "
                                                  "of .'DEFAULT', 'MEMORY', 'DISK', 'SHARED'."):
            StoreOptions(durability=bad)  # type: ignore[arg-type]
    for same in (Durability.DISK, 2, np.int64(2), "DISK", "disk"):
        assert StoreOptions(durability=same).durability is Durability.DISK  # type: ignore[arg-type]
    assert StoreOptions(ttl_s=np.int64(5)).ttl_s == 5 and type(StoreOptions(ttl_s=5).ttl_s) is int
    for bad in (True, 5.0, -1, "5"):
        with pytest.raises(InvalidArgument, match="ttl_s must be a whole number >= 0"):
            StoreOptions(ttl_s=bad)  # type: ignore[arg-type]
    for long in (MAX_TTL_S + 1, 2**64, 10**30):  # as good as never: cut to the longest kept
        assert StoreOptions(ttl_s=long).ttl_s == MAX_TTL_S
