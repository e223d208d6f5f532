"""``codec.api.entry_bodies``: an entry's layer bodies for a whole-entry (GPU) decode, walked
by a compiled loop instead of Python per record, must be exactly what ``unhashed_records``
gives (the same views, specs and the addresses the views lie at), and on damaged bytes must
raise exactly the error ``unhashed_records`` raises."""

from __future__ import annotations

import pytest

from kdn import codec
from kdn.codec import gpu_source
from kdn.codec.api import entry_bodies, record_specs, unhashed_records
from kdn.codec.format import FRAME_STRUCT, parse_container, seal
from kdn.errors import KDNError
from tests.helpers import pruned_layout, random_kv, uniform_layout

pytest.importorskip("numba")

CASES = [("raw", ""), ("int8", ""), ("kdn", "default"), ("lossless", "")]


def _blob(mode: str, level: str, layout_kind: str, layers_per_frame: int) -> bytes:
    layout = pruned_layout() if layout_kind == "pruned" else uniform_layout(layers=6)
    kv = random_kv(layout, 40, seed=7)
    return codec.encode(kv, mode, level, layers_per_frame=layers_per_frame)


@pytest.mark.parametrize("mode,level", CASES)
@pytest.mark.parametrize("layout_kind", ["uniform", "pruned"])
@pytest.mark.parametrize("per_frame", [0, 1, 4])
def test_the_walk_gives_what_the_records_give(mode: str, level: str, layout_kind: str,
                                              per_frame: int) -> None:
    c = parse_container(_blob(mode, level, layout_kind, per_frame), verify=False)
    got = entry_bodies(c.header, c.frames)
    recs = unhashed_records(c.header, c.frames)
    assert [bytes(b) for b in got.bodies] == [bytes(r.body) for r in recs]
    assert got.addresses == [gpu_source.address(r.body) for r in recs]
    assert got.specs == record_specs(c.header.layout, recs)


def _error(fn: object) -> str:
    try:
        fn()  # type: ignore[operator]
    except KDNError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _resealed(blob: bytes, at: int, value: int) -> tuple[object, list[bytes]]:
    """The container with byte ``at`` of its first frame's payload set to ``value``, and
    every sum made right again (the damage reaches the walk)."""
    c = parse_container(blob, verify=False)
    frames = [bytearray(f) for f in c.frames]
    frames[0][FRAME_STRUCT.size + at] = value
    head, sealed = seal(c.header.entry, [bytes(f) for f in frames])
    return parse_container(b"".join([head, *sealed]), verify=False), sealed


@pytest.mark.parametrize("at,value", [(0, 9), (2, 1), (6, 99), (10, 0), (10, 255), (13, 7)],
                         ids=["heads", "tokens", "k-channels", "body-short", "body-long",
                              "body-huge"])
def test_damaged_records_raise_what_the_records_raise(at: int, value: int) -> None:
    c, _ = _resealed(_blob("int8", "", "pruned", 2), at, value)
    want = _error(lambda: unhashed_records(c.header, c.frames))  # type: ignore[attr-defined]
    assert want != "no error"
    assert _error(lambda: entry_bodies(c.header, c.frames)) == want  # type: ignore[attr-defined]


def test_damaged_frames_raise_what_the_records_raise() -> None:
    blob = _blob("kdn", "default", "uniform", 2)
    c = parse_container(blob, verify=False)
    cases = {
        "truncated": [c.frames[0][:-3], *c.frames[1:]],
        "a frame too many": [*c.frames, c.frames[-1]],
        "swapped": [c.frames[1], c.frames[0], *c.frames[2:]],
        "trailing": [bytes(c.frames[0]) + b"\0", *c.frames[1:]],
    }
    for name, frames in cases.items():
        want = _error(lambda f=frames: unhashed_records(c.header, f))
        assert want != "no error", name
        assert _error(lambda f=frames: entry_bodies(c.header, f)) == want, name
    flipped = bytearray(c.frames[0])
    flipped[-1] ^= 1  # a sum that no longer matches: reported as unhashed_records orders it
    frames = [bytes(flipped), *c.frames[1:]]
    assert _error(lambda: entry_bodies(c.header, frames)) == "no error"  # sums: elsewhere
    assert _error(lambda: entry_bodies(c.header, [frames[0][:-1], *frames[1:]], hashed=False)) \
        == _error(lambda: unhashed_records(c.header, [frames[0][:-1], *frames[1:]]))
