"""Content keys: deterministic, namespace- and layout-scoped, stable across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from kdn import keys
from kdn.errors import InvalidArgument
from kdn.names import parse_store_key
from tests.helpers import pruned_layout, uniform_layout


def test_chunk_key_properties() -> None:
    lay = uniform_layout()
    ids = list(range(100, 164))
    k = keys.chunk_key(ids, lay)
    assert len(k) == 32
    assert k == keys.chunk_key(torch.tensor(ids), lay)
    assert k != keys.chunk_key(ids[:-1], lay)
    assert k != keys.chunk_key(ids, lay, namespace="tenant-a")
    assert k != keys.chunk_key(ids, pruned_layout())
    assert k != keys.chunk_key(ids, uniform_layout(model="other"))


def test_prefix_chain() -> None:
    lay = uniform_layout()
    ids = list(range(1000))
    chain = keys.prefix_keys(ids, lay, chunk_tokens=256)
    assert len(chain) == 3  # the 232-token tail has no key
    assert keys.prefix_keys(ids[:700], lay, chunk_tokens=256) == chain[:2]
    changed = ids.copy()
    changed[10] = 7
    other = keys.prefix_keys(changed, lay, chunk_tokens=256)
    assert all(a != b for a, b in zip(chain, other))  # a change early breaks every later link
    changed = ids.copy()
    changed[600] = 7
    assert keys.prefix_keys(changed, lay, chunk_tokens=256)[:2] == chain[:2]
    assert chain[0] != keys.chunk_key(ids[:256], lay)


def test_text_key_uses_tokenizer() -> None:
    class Tok:
        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [ord(c) for c in text]}

    lay = uniform_layout()
    assert keys.text_chunk_key("abc", Tok(), lay) == keys.chunk_key([97, 98, 99], lay)


@pytest.mark.parametrize("ns", ["", "a b", "x" * 65, "../etc", "-lead"])
def test_bad_namespace(ns: str) -> None:
    with pytest.raises(InvalidArgument, match="namespace"):
        keys.chunk_key([1], uniform_layout(), namespace=ns)


def test_bad_tokens_and_keys() -> None:
    with pytest.raises(InvalidArgument):
        keys.chunk_key([-1], uniform_layout())
    lay = uniform_layout()
    in_range = r"\[0, 2\*\*31\)"
    for bad, match in (([1, 2.5], "integers"), ((3, "4"), "integers"), ([1, 2**31], in_range),
                       ([2**70], in_range), ([5, -2], in_range),
                       (np.array([1.0, 2.0]), "integers"),
                       (torch.tensor([1, 2], dtype=torch.bfloat16), "integers, got torch.bf"),
                       (torch.tensor([1, 2], dtype=torch.float16), "integers"),
                       (torch.tensor([1, 2], dtype=torch.complex64), "integers"),
                       (torch.tensor([True, False]), "integers"),
                       ([True, False], "integers, got a bool"), ((3, np.True_), "a bool")):
        with pytest.raises(InvalidArgument, match=match):
            keys.prefix_keys(bad, lay, chunk_tokens=1)  # type: ignore[arg-type]
    # a list, a tuple, an int64 array and a tensor of the same ids: the same keys
    ids = [7, 0, 2**31 - 1, 42]
    want = keys.prefix_keys(ids, lay, chunk_tokens=2)
    assert len(want) == 2
    for same in (tuple(ids), np.array(ids, dtype=np.int64), torch.tensor(ids)):
        assert keys.prefix_keys(same, lay, chunk_tokens=2) == want
    with pytest.raises(InvalidArgument, match="32 bytes"):
        keys.check_key(b"short")


def test_the_numbers_hashed_into_a_key_are_whole() -> None:
    """Block sizes and shard coordinates go into a key as 4-byte words: 2.5, "2", True or 2**40
    were an AttributeError, a TypeError, 1 or an OverflowError, and a rank of 0.5 the key of
    rank 0."""
    lay = uniform_layout()
    for bad, match in ((2.5, "chunk_tokens must be a whole number >= 1, got 2.5"),
                       ("2", "chunk_tokens must be a whole number >= 1, got '2'"),
                       (True, "chunk_tokens must be a whole number >= 1, got True"),
                       (0, "chunk_tokens must be a whole number >= 1, got 0"),
                       (2**40, r"chunk_tokens must be below 2\*\*32")):
        with pytest.raises(InvalidArgument, match=match):
            keys.prefix_keys([1, 2, 3, 4], lay, chunk_tokens=bad)  # type: ignore[arg-type]
    for bad in (4.0, True, -1):
        with pytest.raises(InvalidArgument, match="page_tokens must be a whole number >= 1"):
            keys.page_key("h", lay, page_tokens=bad)  # type: ignore[arg-type]
    for tp, match in (((0.5, 2), "tp's rank must be a whole number >= 0, got 0.5"),
                      ((0, 2.0), "tp's size must be a whole number >= 1, got 2.0"),
                      ((0, "2"), "tp's size must be a whole number"), ((1,), r"\(rank, size\)"),
                      ((2, 2), "0 <= rank < size")):
        with pytest.raises(InvalidArgument, match=match):
            keys.chunk_key([1], lay, tp=tp)  # type: ignore[arg-type]
    assert keys.chunk_key([1], lay, tp=(1, 2)) != keys.chunk_key([1], lay, tp=(0, 2))
    k = keys.chunk_key([1], lay)
    for bad in (None, b"int8", ""):
        with pytest.raises(InvalidArgument, match="encoding must be an encoding's name"):
            keys.variant_key(k, bad)  # type: ignore[arg-type]


def test_store_key_format_and_split() -> None:
    key = bytes(range(32))
    assert keys.store_key("", "default", key) == b"default/" + key.hex().encode()
    assert keys.store_key("team-a", "docs", key) == b"team-a:docs/" + key.hex().encode()
    assert keys.split_store_key(keys.store_key("team-a", "docs", key)) == ("team-a", "docs", key)
    assert keys.split_store_key(keys.store_key("", "docs", key)) == ("", "docs", key)
    assert type(keys.variant_key(bytearray(key), "lossless")) is bytes  # noqa: E721
    with pytest.raises(InvalidArgument, match="tenant"):
        keys.store_key("a:b", "docs", key)
    with pytest.raises(InvalidArgument, match="namespace"):
        keys.store_key("team-a", "a/b", key)
    with pytest.raises(InvalidArgument, match="32 bytes"):
        keys.store_key("team-a", "docs", b"short")


def test_a_tier_key_no_store_key_made_is_not_split() -> None:
    """Only store_key's own form splits: a tier key another writer left in a shared tier
    splits to nothing, not to a short key, an alias of a real key or names no check takes."""
    h = "ab" * 32
    assert parse_store_key(b"default/" + h.encode()) == ("", "default", bytes.fromhex(h))
    for foreign in (b"default/" + ("00" * 21 + " " * 22).encode(),  # 21 bytes of hex
                    b"default/" + h.upper().encode(),  # the lowercase key's triple again
                    b"Bad NS!/" + h.encode(), b"/" + h.encode(), b"a:b:c/" + h.encode(),
                    b"T:x/" + h.encode(), b":x/" + h.encode(), b"default/" + h.encode() + b"\n",
                    b"default/" + h[:-2].encode(), b"d\xc3\xa9/" + h.encode()):
        assert parse_store_key(foreign) is None, foreign
        with pytest.raises(ValueError, match="not a kdn tier key"):
            keys.split_store_key(foreign)


def test_same_key_in_processes_with_different_hash_seeds() -> None:
    code = (
        "from kdn import keys; from tests.helpers import pruned_layout;"
        "l = pruned_layout();"
        "print(keys.chunk_key(list(range(50)), l, 'ns').hex(),"
        " keys.prefix_keys(list(range(600)), l)[-1].hex())"
    )
    outs = set()
    for seed in ("0", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                text=True, check=True).stdout.strip())
    lay = pruned_layout()
    here = (keys.chunk_key(list(range(50)), lay, "ns").hex() + " "
            + keys.prefix_keys(list(range(600)), lay)[-1].hex())
    assert outs == {here}


def test_keys_name_one_sequence_of_at_least_one_token() -> None:
    """A batch was hashed flattened: the key of two prompts was the key of their
    concatenation; an engine's [1, n] input_ids is one sequence; no tokens has no chunk key."""
    lay = uniform_layout()
    want = keys.chunk_key([1, 2, 3], lay)
    chain = keys.prefix_keys([1, 2, 3], lay, chunk_tokens=1)
    for one in (torch.tensor([[1, 2, 3]]), np.array([[1, 2, 3]])):
        assert keys.chunk_key(one, lay) == want
        assert keys.prefix_keys(one, lay, chunk_tokens=1) == chain
    for batch in (torch.tensor([[1, 2, 3], [4, 5, 6]]), np.array([[1, 2, 3], [4, 5, 6]]),
                  torch.tensor(7), np.ones((1, 1, 3), dtype=np.int64)):
        with pytest.raises(InvalidArgument, match="one sequence"):
            keys.chunk_key(batch, lay)
        with pytest.raises(InvalidArgument, match="one sequence"):
            keys.prefix_keys(batch, lay, chunk_tokens=1)
    for none in ([], (), torch.tensor([], dtype=torch.long), np.zeros((1, 0), dtype=np.int64)):
        with pytest.raises(InvalidArgument, match="at least one token"):
            keys.chunk_key(none, lay)
    assert keys.prefix_keys([], lay, chunk_tokens=1) == []
