"""Client side of the Blend RPC: ask a server that hosts the model to compose chunks and text.

    stream = client.blend_stream([RemotePiece(text=system),
                                  RemotePiece(ids=c1_ids, key=chunk_key(c1_ids, layout)),
                                  RemotePiece(ids=question_ids)], ratio=0.15, store=True)
    kv = stream.result()      # the blended KVCache; stream.tier is "blend" when computed now,
                              # or the tier a stored combination was read from

The answer is a Retrieve stream, so layers arrive and decode one by one (``LayerStream``).
This module holds the request side (``RemotePiece``, ``blend_request``); ``Client.blend_stream``
and ``Client.blend`` issue the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kdn.checks import share, shown, token_ids, whole
from kdn.codec.catalog import check_codec
from kdn.errors import InvalidArgument
from kdn.layout import KVLayout
from kdn.names import check_key
from kdn.text import check_text
from kdn.v1 import kdn_pb2 as pb

UINT32_MAX = 2**32 - 1


@dataclass(frozen=True)
class RemotePiece:
    """A run of prompt tokens: a stored chunk (``key`` and its ``ids``) or text (ids or text).
    The server tokenizes ``text`` as ``kdn.text.tokenize`` does by default: special tokens
    written in it (``"<|im_start|>"``) are the tokenizer's; give untrusted text as ``ids``
    (``kdn.text.tokenize(..., literal=True)``) to keep them plain characters."""

    ids: Sequence[int] = field(default_factory=tuple)
    key: bytes = b""
    text: str = ""


def blend_request(pieces: Sequence[RemotePiece], *, namespace: str, ratio: float | None,
                  select_layer: int, head_tokens: int, per_chunk: bool, store: bool, mode: str,
                  level: str, layout: KVLayout | None, query_share: float | None = None
                  ) -> pb.BlendRequest:
    """The request of a Blend; each option is checked here (InvalidArgument naming it), not
    left to protobuf (a ValueError or TypeError naming none)."""
    for name, value in (("ratio", ratio), ("query_share", query_share)):
        if value is not None:
            share(name, value)
    for name, number, hint in (("select_layer", select_layer, " (0: the default)"),
                               ("head_tokens", head_tokens, "")):
        if whole(name, number, 0, hint) > UINT32_MAX:  # uint32 on the wire
            raise InvalidArgument(f"{name} must be at most {UINT32_MAX}, got {number!r}")
    for name, flag in (("per_chunk", per_chunk), ("store", store)):
        if not isinstance(flag, bool):
            raise InvalidArgument(f"{name} must be a bool, got {shown(flag)}")
    for name, text in (("mode", mode), ("level", level)):
        if not isinstance(text, str):
            raise InvalidArgument(f"{name} must be a str, got {shown(text)}")
    check_codec(mode or "lossless", level)
    if layout is not None and not isinstance(layout, KVLayout):
        raise InvalidArgument(f"layout must be a kdn.layout.KVLayout or None, got "
                              f"{type(layout).__name__}")
    ids, keys = [], []
    for j, p in enumerate(pieces):
        if not isinstance(p, RemotePiece):
            raise InvalidArgument(f"piece {j} must be a kdn.client.blend.RemotePiece, got "
                                  f"{type(p).__name__}")
        check_text(p.text, f"piece {j}'s text")  # protobuf would raise UnicodeEncodeError
        ids.append(token_ids(p.ids, f"piece {j}'s ids", UINT32_MAX + 1))  # uint32 on the wire
        try:
            keys.append(check_key(p.key) if p.key != b"" else b"")  # b"": text
        except InvalidArgument as e:
            raise InvalidArgument(f"piece {j}'s {e}") from None
    req = pb.BlendRequest(
        namespace=namespace, select_layer=select_layer, head_tokens=head_tokens,
        per_chunk=per_chunk, store=store, mode=mode, level=level,
        expect_layout_fingerprint=layout.fingerprint if layout is not None else "",
        pieces=[pb.BlendPiece(chunk_key=k, token_ids=i, text=p.text)
                for p, i, k in zip(pieces, ids, keys)],
    )
    if ratio is not None:
        req.ratio = ratio
    if query_share is not None:
        req.query_share = query_share
    return req
