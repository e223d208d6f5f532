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

from kdn.checks import token_ids
from kdn.layout import KVLayout
from kdn.text import check_text
from kdn.v1 import kdn_pb2 as pb


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
    ids = []
    for j, p in enumerate(pieces):
        check_text(p.text, f"piece {j}'s text")  # protobuf would raise UnicodeEncodeError
        ids.append(token_ids(p.ids, f"piece {j}'s ids"))  # uint32 on the wire: not int(1.7)
    req = pb.BlendRequest(
        namespace=namespace, select_layer=select_layer, head_tokens=head_tokens,
        per_chunk=per_chunk, store=store, mode=mode, level=level,
        expect_layout_fingerprint=layout.fingerprint if layout is not None else "",
        pieces=[pb.BlendPiece(chunk_key=p.key, token_ids=i, text=p.text)
                for p, i in zip(pieces, ids)],
    )
    if ratio is not None:
        req.ratio = ratio
    if query_share is not None:
        req.query_share = query_share
    return req
