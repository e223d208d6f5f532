"""Request messages checked before any handler sees them: malformed bytes and malformed names.

The request interceptor (``kdn.server.observe``) gives every method of every service it serves
the deserializer ``checked(deserializer, rpc)``. A message that does not parse (not protobuf,
invalid UTF-8 in a string field, a wrong wire type...) or that carries a malformed name becomes
a ``BadRequest`` in place of the message, instead of an exception inside gRPC (answered UNKNOWN
with Python's exception text); the interceptor answers it with INVALID_ARGUMENT and the
``BadRequest``'s one-line message: for a unary request before the handler runs, for a streamed
one (Store, Import) at the message that is bad.

Names are checked by field name, wherever a request message holds them (sub-messages and
repeated fields included), with the rules of ``kdn.names``:

    namespace   a namespace ("" = the default namespace, or every namespace in a listing)
    tenant      a tenant ("" = every tenant)
    key, keys   a key (at most ``kdn.names.MAX_CALL_KEYS`` keys in one request: in ``keys``,
                or in the repeated messages holding a ``key`` each, PutMany's items)
    chunk_key   a key ("" = a text piece)
    key_prefix  a key prefix

so a handler never sees a malformed name, not even one it would not look at (a Lookup of no
keys still names a namespace). ``NOT_NAMES`` lists every other string and bytes field of the
request messages; a test checks that each such field of ``kdn.v1`` is in one list or the other,
so a name field added later can not go unchecked. The handlers check names again where they
build tier keys (``kdn.keys.store_key``), with the same functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

from kdn.errors import InvalidArgument
from kdn.names import (
    MAX_CALL_KEYS,
    check_key,
    check_key_prefix,
    check_namespace,
    check_scope,
)


def _optional(rule: Callable[[Any], object]) -> Callable[[Any], object]:
    return lambda value: rule(value) if value else value


NAME_RULES: dict[str, Callable[[Any], object]] = {
    "namespace": _optional(check_namespace),
    "tenant": _optional(check_scope),
    "key": check_key,
    "keys": check_key,
    "chunk_key": _optional(check_key),
    "key_prefix": check_key_prefix,
}
"""Rule of each name field, by field name (applied to each element of a repeated field)."""

NOT_NAMES = frozenset({
    "kdn.v1.StoreHeader.container_header", "kdn.v1.StoreHeader.layout_fingerprint",
    "kdn.v1.Frame.data",
    "kdn.v1.RetrieveRequest.expect_layout_fingerprint",
    "kdn.v1.RetrieveManyRequest.expect_layout_fingerprint",
    "kdn.v1.GetManyRequest.segment_id", "kdn.v1.GetManyRequest.expect_layout_fingerprint",
    "kdn.v1.PutManyRequest.segment_id", "kdn.v1.PutItem.data",
    "kdn.v1.AttachRequest.nonce", "kdn.v1.DetachRequest.segment_id",
    "kdn.v1.BlendPiece.text", "kdn.v1.BlendRequest.mode", "kdn.v1.BlendRequest.level",
    "kdn.v1.BlendRequest.expect_layout_fingerprint",
    "kdn.v1.ListRequest.model_fingerprint", "kdn.v1.ListRequest.page_token",
    "kdn.v1.KeysRequest.tier", "kdn.v1.ExportRequest.after", "kdn.v1.ImportItem.value",
})
"""String and bytes fields of request messages that are not names (checked by the handlers:
layouts, segments, cursors, opaque bytes)."""

_TEXT = (FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_BYTES)


@dataclass(frozen=True, slots=True)
class BadRequest:
    """Stands in for a request message that was malformed; ``message`` says how (one line)."""

    message: str


@dataclass(frozen=True)
class _Plan:
    """What to check in messages of one type: name fields, and message fields holding names."""

    names: tuple[tuple[str, bool, Callable[[Any], object]], ...]
    subs: tuple[tuple[str, bool, _Plan], ...]


_plans: dict[str, _Plan | None] = {}


def _plan(desc: Any) -> _Plan | None:
    """The checks for messages of type ``desc`` (a message Descriptor); None when they hold no
    names."""
    if desc.full_name in _plans:
        return _plans[desc.full_name]
    _plans[desc.full_name] = None  # a recursive message type holds names once, not forever
    names, subs = [], []
    for f in desc.fields:
        if f.type == FieldDescriptor.TYPE_MESSAGE:
            sub_type = f.message_type
            sub = None if sub_type is None or sub_type.GetOptions().map_entry else \
                _plan(sub_type)
            if sub is not None:
                subs.append((f.name, f.is_repeated, sub))
        elif f.type in _TEXT and f.name in NAME_RULES:
            names.append((f.name, f.is_repeated, NAME_RULES[f.name]))
    plan = _Plan(tuple(names), tuple(subs)) if names or subs else None
    _plans[desc.full_name] = plan
    return plan


def _check(msg: Message, plan: _Plan, where: str) -> None:
    for name, repeated, rule in plan.names:
        value = getattr(msg, name)
        if repeated and len(value) > MAX_CALL_KEYS:
            raise InvalidArgument(f"{where}{name}: {len(value)} names in one call; at most "
                                  f"{MAX_CALL_KEYS} (kdn's client sends more in several)")
        for i, v in enumerate(value if repeated else (value,)):
            try:
                rule(v)
            except InvalidArgument as exc:  # the rule's message names the kind of name
                at = f"{where}{name}[{i}]" if repeated else where + name
                raise InvalidArgument(f"{at}: {exc}" if at != name else str(exc)) from None
    for name, repeated, sub in plan.subs:
        if repeated:
            items = getattr(msg, name)
            if len(items) > MAX_CALL_KEYS and any(n[0] == "key" for n in sub.names):
                raise InvalidArgument(f"{where}{name}: {len(items)} keys in one call; at most "
                                      f"{MAX_CALL_KEYS} (kdn's client sends more in several)")
            for i, m in enumerate(items):
                _check(m, sub, f"{where}{name}[{i}].")
        elif msg.HasField(name):
            _check(getattr(msg, name), sub, f"{where}{name}.")


def check_names(msg: object) -> None:
    """Raise InvalidArgument (naming the field) when ``msg`` holds a malformed name."""
    if isinstance(msg, Message):
        plan = _plan(msg.DESCRIPTOR)
        if plan is not None:
            _check(msg, plan, "")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def checked(deserialize: Callable[[bytes], Any], rpc: str, max_bytes: int = 0
            ) -> Callable[[bytes], Any]:
    """``deserialize`` returning a ``BadRequest`` for a malformed message or name, or for a
    message over ``max_bytes`` (0: no bound beyond the server's max_message_bytes)."""

    def parse(buf: bytes) -> Any:
        if max_bytes and len(buf) > max_bytes:
            return BadRequest(f"{rpc} request message of {len(buf)} bytes is over the "
                              f"{max_bytes} this service takes")
        try:
            msg = deserialize(buf)
        except Exception as exc:  # protobuf's DecodeError, or what a custom parser raises
            return BadRequest(f"malformed {rpc} request message ({len(buf)} bytes): "
                              f"{_first_line(exc)}")
        try:
            check_names(msg)
        except InvalidArgument as exc:
            return BadRequest(f"{rpc} request: {exc}")
        return msg

    return parse
