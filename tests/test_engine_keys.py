"""Keys for engines: adapter id, TP/PP shard and salt scope a key; the defaults do not.

The pinned hex digests were computed with the key code as it was before these options were
added: a change to them would orphan every entry already stored.
"""

from __future__ import annotations

import pytest

from kdn import keys
from kdn.errors import InvalidArgument
from tests.helpers import pruned_layout, uniform_layout

PINNED_CHUNK = "060e8d0ef77ace9bf351adcee5ba67fd127a2940e235732a892a85314ae968dc"
PINNED_CHUNK_NS = "28fec9f4ec07685844ed2a7eb9f5976a5adf0650ed5f075626a57eff07003c4c"
PINNED_PREFIX = ["6eeb03371eb924fb213c4074ffe4607198104e05cc0ae2cc18d8b655aca60953",
                 "e6494fda586338da0641dc115652e64b6ffd1ec0d047b47b89bbae7b2778de83"]
PINNED_VARIANT = "0912301b17fa9deb0db8141f4edae2b928dcb44ddeb085eb41c6f98ada8fdf11"


def test_defaults_keep_the_pinned_keys() -> None:
    lay = uniform_layout()
    assert keys.chunk_key(list(range(100, 164)), lay).hex() == PINNED_CHUNK
    assert keys.chunk_key([1, 2, 3], pruned_layout(), namespace="tenant-a").hex() \
        == PINNED_CHUNK_NS
    assert [k.hex() for k in keys.prefix_keys(list(range(600)), lay, chunk_tokens=256)] \
        == PINNED_PREFIX
    assert keys.variant_key(keys.chunk_key([5], lay), "int8").hex() == PINNED_VARIANT
    # the explicit defaults are the defaults; (0, 1) is the whole model, as no shard
    assert keys.chunk_key(list(range(100, 164)), lay, adapter="", tp=(0, 1), salt=b"").hex() \
        == PINNED_CHUNK
    assert [k.hex() for k in keys.prefix_keys(list(range(600)), lay, chunk_tokens=256,
                                              tp=None, salt="")] == PINNED_PREFIX


SCOPES = [
    {"adapter": "lora-a"},
    {"adapter": "lora-b"},
    {"tp": (0, 2)},
    {"tp": (1, 2)},
    {"tp": (0, 4)},
    {"salt": "user-1"},
    {"salt": b"user-2"},
    {"adapter": "lora-a", "tp": (1, 2), "salt": "user-1"},
]


def test_each_option_changes_chunk_and_prefix_keys() -> None:
    lay = uniform_layout()
    ids = list(range(600))
    chunk = {keys.chunk_key(ids, lay, **s) for s in SCOPES}  # type: ignore[arg-type]
    assert len(chunk) == len(SCOPES) and keys.chunk_key(ids, lay) not in chunk
    base = keys.prefix_keys(ids, lay, chunk_tokens=256)
    chains = [keys.prefix_keys(ids, lay, chunk_tokens=256, **s)  # type: ignore[arg-type]
              for s in SCOPES]
    for chain in chains:  # the scope is in the root: every link differs
        assert len(chain) == 2 and all(a != b for a, b in zip(chain, base))
    assert len({c[-1] for c in chains}) == len(SCOPES)
    # a str salt and its utf-8 bytes are one salt
    assert keys.chunk_key(ids, lay, salt="s") == keys.chunk_key(ids, lay, salt=b"s")


def test_text_key_passes_the_scope() -> None:
    class Tok:
        def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
            return {"input_ids": [ord(c) for c in text]}

    lay = uniform_layout()
    assert keys.text_chunk_key("abc", Tok(), lay, adapter="x", tp=(1, 2), salt="s") \
        == keys.chunk_key([97, 98, 99], lay, adapter="x", tp=(1, 2), salt="s")


def test_page_key() -> None:
    lay = uniform_layout()
    k = keys.page_key("ab12", lay, page_tokens=64)
    assert len(k) == 32 and k == keys.page_key(b"ab12", lay, page_tokens=64)
    others = [
        keys.page_key("ab13", lay, page_tokens=64),
        keys.page_key("ab12", lay, page_tokens=32),
        keys.page_key("ab12", lay, "other-ns", page_tokens=64),
        keys.page_key("ab12", uniform_layout(model="other"), page_tokens=64),
        keys.page_key("ab12", uniform_layout(heads=1), page_tokens=64),
        keys.page_key("ab12", lay, page_tokens=64, tp=(1, 2)),
        keys.page_key("ab12", lay, page_tokens=64, pp=(1, 2)),
        keys.page_key("ab12", lay, page_tokens=64, adapter="lora"),
        keys.page_key("ab12", lay, page_tokens=64, salt="s"),
    ]
    assert len({k, *others}) == len(others) + 1
    assert keys.page_key("ab12", lay, page_tokens=64, tp=(0, 1), pp=(0, 1)) == k
    assert keys.page_key("ab12", lay, page_tokens=64, tp=(1, 2)) \
        != keys.page_key("ab12", lay, page_tokens=64, pp=(1, 2))  # tp and pp are not one axis


@pytest.mark.parametrize("bad", [
    {"tp": (2, 2)}, {"tp": (-1, 2)}, {"tp": (0, 0)}, {"tp": "0/2"}, {"adapter": 3},
    {"salt": 7},
])
def test_bad_scope(bad: dict) -> None:
    with pytest.raises(InvalidArgument):
        keys.chunk_key([1], uniform_layout(), **bad)


def test_bad_page_key() -> None:
    with pytest.raises(InvalidArgument, match="page_tokens"):
        keys.page_key("a", uniform_layout(), page_tokens=0)
    with pytest.raises(InvalidArgument, match="page_hash"):
        keys.page_key("", uniform_layout(), page_tokens=4)
