"""What a store takes, checked before anything is written or sent: an entry (``check_entry``:
a ``KVCache``, ``EncodedParts`` or ``Staged``), a batch of (key, entry) pairs with each key
once (``check_items``), ``StoreOptions`` (``check_options``), the codec an entry is encoded
with (``check_encoding``), and a batch's entries encoded elsewhere (``check_encoded``).
``is_kv`` and ``is_staged`` tell the kinds apart without importing torch (``kdn.client`` loads
without it).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeGuard, TypeVar

from kdn.checks import whole
from kdn.codec import EncodedParts
from kdn.codec.catalog import check_codec
from kdn.codec.format import check_frame, parse_header
from kdn.errors import Corrupt, InvalidArgument, KDNError
from kdn.keys import check_key
from kdn.options import StoreOptions

if TYPE_CHECKING:
    from kdn.cache import KVCache
    from kdn.client.staged import Staged

E = TypeVar("E")


def is_staged(kv: object) -> TypeGuard[Staged]:
    """Whether ``kv`` is a ``kdn.client.staged.Staged`` (none exists before that module, which
    needs torch, was imported: ``_instance``)."""
    return _instance(kv, "kdn.client.staged", "Staged")


def is_kv(kv: object) -> TypeGuard[KVCache]:
    """Whether ``kv`` is a ``kdn.cache.KVCache`` (none exists before that module, which needs
    torch, was imported: ``_instance``)."""
    return _instance(kv, "kdn.cache", "KVCache")


def _instance(obj: object, module: str, name: str) -> bool:
    """Whether ``obj`` is an instance of class ``name`` of ``module``, without importing it.
    A module another thread is still importing is in ``sys.modules`` before its classes are
    made (a first raw store imports ``kdn.client.staged``): until ``name`` is there, no
    instance of it exists."""
    cls = getattr(sys.modules.get(module), name, None)
    return cls is not None and isinstance(obj, cls)


def check_entry(kv: E, what: str = "") -> E:
    """``kv`` when it is what a store takes (a ``KVCache``, ``EncodedParts`` of bytes or a
    ``Staged`` entry), else InvalidArgument (naming ``what``, a batch's item): checked before
    a batch writes or sends anything (a staged item went before a bad one was found; an
    EncodedParts of str frames was a TypeError from deep in a data path)."""
    if isinstance(kv, EncodedParts):
        _check_parts(kv, f"{what}: " if what else "")
    elif not (is_kv(kv) or is_staged(kv)):
        raise InvalidArgument(f"{what + ': ' if what else ''}expected a KVCache (or "
                              f"EncodedParts, Staged) to store, got {type(kv).__name__}")
    return kv


def _check_parts(parts: EncodedParts, where: str) -> None:
    """InvalidArgument unless ``parts`` holds a bytes-like header and a list of bytes-like
    frames."""
    if not _bytes_like(parts.header):
        raise InvalidArgument(f"{where}EncodedParts.header must be bytes, got "
                              f"{type(parts.header).__name__}")
    if not isinstance(parts.frames, (list, tuple)):
        raise InvalidArgument(f"{where}EncodedParts.frames must be a list of bytes, got "
                              f"{type(parts.frames).__name__}")
    for i, frame in enumerate(parts.frames):
        if not _bytes_like(frame):
            raise InvalidArgument(f"{where}EncodedParts frame {i} must be bytes, got "
                                  f"{type(frame).__name__}")


def _bytes_like(obj: object) -> bool:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return True
    try:
        memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True


def check_items(items: object) -> list[tuple[bytes, KVCache | EncodedParts | Staged]]:
    """``store_many``'s items as (key, entry) pairs, each checked as ``store`` checks its
    own, else InvalidArgument naming the first that is not: something other than a pair,
    or a key given twice (which of its entries a server ends up holding would depend on the
    path each took)."""
    if isinstance(items, (dict, str, bytes, bytearray, memoryview)) or not isinstance(
            items, Iterable):
        hint = " (a dict: list(d.items()))" if isinstance(items, dict) else ""
        raise InvalidArgument(f"store_many takes a list of (key, entry) pairs, got "
                              f"{type(items).__name__}{hint}")
    out: list[tuple[bytes, KVCache | EncodedParts | Staged]] = []
    seen: dict[bytes, int] = {}
    for j, item in enumerate(items):
        if not isinstance(item, (tuple, list)) or len(item) != 2:
            what = (f"a {type(item).__name__} of {len(item)}" if isinstance(item, (tuple, list))
                    else type(item).__name__)
            raise InvalidArgument(f"item {j} of store_many must be a (key, entry) pair, got "
                                  f"{what}")
        key = check_key(item[0])
        if key in seen:
            raise InvalidArgument(f"key {key.hex()} is items {seen[key]} and {j} of one "
                                  "store_many: give each key once")
        seen[key] = j
        out.append((key, check_entry(item[1], f"item {j}")))
    return out


def check_options(options: object) -> StoreOptions | None:
    """``options`` when it is None or a ``StoreOptions``, else InvalidArgument."""
    if options is not None and not isinstance(options, StoreOptions):
        raise InvalidArgument(f"options must be a kdn.StoreOptions (StoreOptions(ttl_s=..., "
                              f"pin=..., durability=...)), got {type(options).__name__}")
    return options


def check_encoding(mode: str, level: str, layers_per_frame: int) -> None:
    """Raise InvalidArgument unless ``mode``/``level`` name a codec and ``layers_per_frame`` is
    a whole number >= 0: checked before a store writes or sends anything (a batch's staged
    items were stored before its other entries were encoded and a mistyped mode found)."""
    check_codec(mode, level)
    whole("layers_per_frame", layers_per_frame, 0, " (0: frames of about FRAME_TARGET_BYTES)")


def check_encoded(items: list[tuple[bytes, KVCache | EncodedParts | Staged]]) -> None:
    """Each ``EncodedParts`` of a batch (encoded elsewhere: this client's own encodings are
    sound by construction) checked as the server checks it, its header, frame count and each
    frame's sum and records, else the server's error naming the caller's item (Corrupt as
    InvalidArgument): a batch split over several calls is checked whole before the first (a
    damaged last entry left the calls before its own stored, and was named by its index in
    that call)."""
    for j, (_, kv) in enumerate(items):
        if not isinstance(kv, EncodedParts):
            continue
        try:
            header = parse_header(kv.header)
            if len(kv.frames) != len(header.entry.frames):
                raise Corrupt(f"{len(kv.frames)} frames, its header lists "
                              f"{len(header.entry.frames)}")
            for i, frame in enumerate(kv.frames):
                check_frame(header, i, frame, records=False)
        except Corrupt as exc:
            raise InvalidArgument(f"item {j}: corrupt input: {exc}") from exc
        except KDNError as exc:
            raise type(exc)(f"item {j}: {exc}") from exc
