"""Wrong arguments to the data model, the keys and the codec are kdn errors naming what is
wrong (they were raw AttributeError, TypeError, UnicodeEncodeError, OverflowError from Python,
torch or protobuf). The layout's own fields: tests/test_layout_fields.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from kdn import checks, codec, keys
from kdn.cache import KVCache
from kdn.errors import InvalidArgument
from kdn.options import StoreOptions
from tests.helpers import random_kv, uniform_layout

LAY = uniform_layout(layers=2, dim=8)
KV = random_kv(LAY, 4)
PARTS = codec.encode_parts(KV, "raw")
KEY = keys.chunk_key([1, 2], LAY)

CALLS: dict[str, tuple[Callable[[], Any], str]] = {
    "chunk_key(ids, None)": (lambda: keys.chunk_key([1, 2], None), "layout must be a KVLayout"),
    "prefix_keys(ids, 'm')": (lambda: keys.prefix_keys([1, 2], "m", chunk_tokens=1),
                              "layout must be a KVLayout"),
    "page_key(h, None)": (lambda: keys.page_key("h", None, page_tokens=1),
                          "layout must be a KVLayout"),
    "prefix_keys(extras=None)": (lambda: keys.prefix_keys([1, 2], LAY, chunk_tokens=1,
                                                          extras=None), "extras"),
    "variant_key(key, lone surrogate)": (lambda: keys.variant_key(KEY, "\ud800"),
                                         "not valid Unicode"),
    "concat([kv, 'x'])": (lambda: KVCache.concat([KV, "x"]), "part 1 is str"),
    "kv.slice(None)": (lambda: KV.slice(None), "start must be a whole number"),
    "kv.slice(1.5)": (lambda: KV.slice(1.5), "start must be a whole number"),
    "kv.slice(0, 2.0)": (lambda: KV.slice(0, 2.0), "stop must be a whole number"),
    "whole(2.0)": (lambda: checks.whole("n", 2.0), r"got 2\.0 \(an int is needed, not float\)"),
    "StoreOptions(ttl_s=60.0)": (lambda: StoreOptions(ttl_s=60.0),
                                 r"got 60\.0 \(an int is needed, not float\)"),
    "StreamDecoder(None)": (lambda: codec.StreamDecoder(None), "container header"),
    "StreamDecoder('x')": (lambda: codec.StreamDecoder("x"), "container header"),
    "decode_frame(0, None)": (lambda: codec.StreamDecoder(PARTS.header).decode_frame(0, None),
                              "frame 0 must be bytes"),
    "decode_frame(None, frame)": (lambda: codec.StreamDecoder(PARTS.header).decode_frame(
        None, PARTS.frames[0]), "frame index"),
    "decode_frame(1.0, frame)": (lambda: codec.StreamDecoder(PARTS.header).decode_frame(
        1.0, PARTS.frames[0]), "frame index"),
    "encode(kv, ['raw'])": (lambda: codec.encode(KV, ["raw"]), "unknown codec mode"),
    "share(10**400)": (lambda: checks.share("ratio", 10**400), "ratio must be a number"),
    "share(-10**400)": (lambda: checks.share("ratio", -10**400), "ratio must be a number"),
    "seconds(10**400)": (lambda: checks.seconds("timeout", 10**400), "timeout must be a"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_a_wrong_argument_is_named(name: str) -> None:
    call, match = CALLS[name]
    with pytest.raises(InvalidArgument, match=match):
        call()


def test_the_right_arguments_still_work() -> None:
    assert KV.slice(1, 3).num_tokens == 2 and KVCache.concat([KV.slice(0, 1), KV.slice(1)])\
        .equal(KV)
    assert checks.share("ratio", 1) == 1.0 and checks.seconds("t", 10**3) == 1000.0
    dec = codec.StreamDecoder(bytes(PARTS.header))
    assert [layer for layer, _, _ in dec.decode_frame(0, bytearray(PARTS.frames[0]))] == [0]
    assert len(keys.prefix_keys([1, 2], LAY, chunk_tokens=1, extras=[b"x"])) == 2
