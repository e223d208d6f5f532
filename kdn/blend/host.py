"""The model side of the Blend RPC: a server that hosts a model composes stored chunks and text.

The storage server imports no model code. It is handed an object with this module's
``ModelBlender`` shape (``kdn.server.blend_rpc.Blender``) by whoever builds it (``kdn serve
--model``, or a test), and does the I/O around it: reading chunk entries (tenant-scoped),
looking up and storing combinations, streaming the answer.

Lifecycle of one Blend request on the model side:

1. ``plan(request, read_chunk, max_pieces)``, on a worker thread: the model is loaded on first
   use (``kdn.model.models.load_model``, memoised), and must be of a family the blender
   computes exactly (``kdn.model.families``; ModelUnavailable else: ``kdn serve --model``
   refuses a folder of another family at start); the pieces (``max_pieces``), tokens (the
   model's context) and text characters (``MAX_CHARS_PER_TOKEN`` a token of it) are bounded
   first; text pieces are tokenized (or taken as ids); each
   chunk's stored entry is read through ``read_chunk``, once however many pieces name it, and
   each piece's ids must hash to its key (``kdn.keys.chunk_key`` under the chunk's stored
   layout), so the KV and the ids agree (an entry under the key of its ids in another dtype
   is a LayoutMismatch saying so); each chunk's layout must be this model's, kept
   channels, head_dim and RoPE included (``kdn.blend.blend.check_chunk_layout``; only the
   dtype may differ). The result is named by the layout blend() gives it, the model's
   (``blend_layout``), never by a chunk's. With ``request.store`` the plan names the
   combination's content key (``kdn.blend.key.combination_key``), which the server looks up
   before running. ``ratio`` and ``query_share`` travel as 32-bit floats: each is read as
   the shortest decimal of its float32 (``sent``), the number the caller wrote.
2. ``job.run()``: ``kdn.blend.blend`` runs, decoding each chunk's layer from the stored frames
   right before the blend loop needs it; one blend runs at a time per blender (the model is
   shared); the result is encoded (``mode``/``level``, default lossless).
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch

from kdn import codec
from kdn.blend.blend import BlendConfig, Piece, blend, blend_layout, check_chunk_layout
from kdn.blend.key import combination_key
from kdn.cache import LayerKV
from kdn.checks import check_vocabulary
from kdn.codec.format import Header, check_frame, parse_header, split_frames
from kdn.errors import (
    InvalidArgument,
    KDNError,
    LayoutMismatch,
    NotFound,
    Status,
    TooLarge,
)
from kdn.keys import check_key, check_namespace, chunk_key
from kdn.layout import DType, KVLayout
from kdn.model.families import blend_problem, check_blended
from kdn.model.hf import model_device, model_layout, place, prompt_limits
from kdn.text import tokenize
from kdn.v1 import kdn_pb2 as pb

MAX_PIECES = 256
"""Most pieces of one blend, unless the server says otherwise (``max_blend_pieces``)."""

MAX_CHARS_PER_TOKEN = 64
"""Most characters a text may hold for each token of the model's context left to it: a text
is refused past it before it is tokenized (tokenizing a request's 256 MiB of text took
minutes and gigabytes, to find it longer than the context). Real text is 3 to 5 characters
a token; whitespace runs a few dozen."""


class ModelUnavailable(KDNError, status=Status.FAILED_PRECONDITION):
    """The model a blender names can not be loaded (a folder that is no model, files missing):
    no Blend can run until the server's model is fixed."""


class StoredChunk:
    """A stored entry as a blend ``LayerSource``: frame f is decoded when a layer in it is asked."""

    def __init__(self, value: bytes, device: torch.device | str | None = None) -> None:
        self.header: Header = parse_header(value)
        self.frames = list(split_frames(value, len(self.header.raw)))
        self.decoder = codec.StreamDecoder(self.header, device)  # layers land on ``device``
        self._frame_of = {span.first_layer + j: f for f, span in
                          enumerate(self.header.entry.frames) for j in range(span.num_layers)}
        self._layers: dict[int, LayerKV] = {}

    @property
    def layout(self) -> KVLayout:
        return self.header.layout

    @property
    def num_tokens(self) -> int:
        return int(self.header.entry.tokens)

    def wait_for_layer(self, i: int, timeout: float | None = None) -> LayerKV:
        if i not in self._layers:
            f = self._frame_of[i]
            check_frame(self.header, f, self.frames[f])
            for layer, k, v in self.decoder.decode_frame(f, self.frames[f]):
                self._layers[layer] = (k, v)
        return self._layers[i]


@dataclass
class BlendJob:
    """A planned blend: ``combination_key`` (b"" unless the request asked to store it), the
    ``tokens`` and ``layout_fingerprint`` of its result, and ``run()``, which computes and
    encodes the blended KV."""

    blender: ModelBlender
    model: Any
    pieces: list[Piece]
    config: BlendConfig
    mode: str
    level: str
    layout_fingerprint: str
    combination_key: bytes = b""

    @property
    def tokens(self) -> int:
        return sum(len(p.ids) for p in self.pieces)

    def run(self, cancelled: Callable[[], bool] | None = None) -> codec.EncodedParts:
        with self.blender.lock:
            result = blend(self.model, self.pieces, self.config, cancelled)
        return codec.encode_parts(result.kv, self.mode, self.level)


class ModelBlender:
    """Blends with ``model``/``tokenizer``, or with the model ``name`` loaded on first use."""

    def __init__(self, model: Any = None, tokenizer: Any = None, *, name: str = "",
                 device: torch.device | str | None = None) -> None:
        if model is None and not name:
            raise InvalidArgument("a ModelBlender needs a model or a model name")
        if model is not None:
            check_blended(model, "a ModelBlender")
        self._loaded: tuple[Any, Any] | None = (model, tokenizer) if model is not None else None
        self.name = name
        self.device = torch.device(device) if device is not None else None
        """Where a model loaded by name runs (None: CUDA when there is one, else the CPU);
        chunks are decoded onto the model's device."""
        self.lock = threading.Lock()

    def model(self) -> tuple[Any, Any]:
        """(model, tokenizer), loading the named model on first use; ModelUnavailable naming
        it where it can not be loaded (each Blend tries again)."""
        if self._loaded is None:
            from kdn.model.models import load_model

            try:
                model, tok = load_model(self.name)
            except KDNError:
                raise
            except Exception as exc:  # transformers' ValueError, OSError of missing files, ...
                raise ModelUnavailable(f"the server's model {self.name!r} can not be loaded: "
                                       f"{type(exc).__name__}: {exc}") from exc
            if (why := blend_problem(model.config)) is not None:
                raise ModelUnavailable(f"the server's model {self.name!r} can not be blended: "
                                       f"{why}")
            self._loaded = (place(model, self.device), tok)
        return self._loaded

    def plan(self, request: pb.BlendRequest, read_chunk: Callable[[bytes], bytes | None],
             max_pieces: int = MAX_PIECES) -> BlendJob:
        """Check and resolve ``request``'s pieces (``read_chunk(key)``: the stored entry of a
        chunk key in the request's namespace, or None); runs on a worker thread.

        A blend's memory and time grow with its pieces and tokens, so both are bounded before
        any text is tokenized or chunk read: at most ``max_pieces`` pieces (the server's
        ``max_blend_pieces``; TooLarge), and at most the model's context of tokens in all
        (``max_position_embeddings``; InvalidArgument). A chunk several pieces name is read
        and decoded once."""
        ns = check_namespace(request.namespace or "default")
        if not request.pieces:
            raise InvalidArgument("Blend needs at least one piece")
        if len(request.pieces) > max_pieces:
            raise TooLarge(f"Blend of {len(request.pieces)} pieces exceeds max_blend_pieces "
                           f"{max_pieces}")
        model, tok = self.model()
        default = BlendConfig()
        cfg = BlendConfig(
            ratio=sent(request.ratio) if request.HasField("ratio") else default.ratio,
            select_layer=request.select_layer or default.select_layer,
            head_tokens=request.head_tokens, per_chunk=request.per_chunk,
            query_share=(sent(request.query_share) if request.HasField("query_share")
                         else default.query_share))
        mode = request.mode or "lossless"
        codec.get_mode(mode).check_level(request.level)
        own = model_layout(model, DType.FLOAT32)
        pieces: list[Piece] = []
        named: list[tuple[bytes, list[int]]] = []
        sources: dict[bytes, StoredChunk] = {}
        for j, (p, ids) in enumerate(zip(request.pieces, token_ids(request, model, tok))):
            if not p.chunk_key:
                pieces.append(Piece(ids))
                named.append((b"", ids))
                continue
            key = check_key(p.chunk_key)
            src = sources.get(key)
            if src is None:
                value = read_chunk(key)
                if value is None:
                    raise NotFound(f"piece {j}: no chunk {key.hex()} in {ns!r}")
                src = sources[key] = StoredChunk(value, model_device(model))
            check_chunk_layout(src.layout, own, f"piece {j}")
            if chunk_key(ids, src.layout, ns) != key:
                raise key_mismatch(j, ids, key, src.layout, own, ns)
            pieces.append(Piece(ids, src))
            named.append((key, ids))
        layout = blend_layout(model, pieces)  # what blend() computes: the model's, not a chunk's
        want = request.expect_layout_fingerprint
        if want and want != layout.fingerprint:
            raise LayoutMismatch(f"blend result has layout {layout.fingerprint}, caller expects "
                                 f"{want}")
        job = BlendJob(self, model, pieces, cfg, mode, request.level, layout.fingerprint)
        if request.store:
            encoding = mode if not request.level else f"{mode}-{request.level}"
            job.combination_key = combination_key(named, layout.fingerprint, cfg, ns, encoding)
        return job


def key_mismatch(j: int, ids: list[int], key: bytes, stored: KVLayout, own: KVLayout,
                 namespace: str) -> KDNError:
    """Why piece ``j``'s ``key`` is not ``chunk_key`` of its ``ids`` under the layout of the
    entry stored there: the key is that of the ids in another dtype (LayoutMismatch: the entry
    holds KV of another layout than its key names), else the ids are not the key's."""
    for dtype in DType:
        other = replace(own, dtype=dtype)
        if dtype is not stored.dtype and chunk_key(ids, other, namespace) == key:
            return LayoutMismatch(f"piece {j}: the entry stored under chunk_key holds "
                                  f"{stored.dtype.value} KV (layout {stored.fingerprint}), "
                                  f"its key names the {dtype.value} layout "
                                  f"{other.fingerprint}: it was stored under another "
                                  f"layout's key")
    return InvalidArgument(f"piece {j}: token_ids do not match chunk_key (under the stored "
                           f"entry's layout {stored.fingerprint}, {stored.dtype.value})")


def sent(value: float) -> float:
    """The number a caller sent as the protobuf ``float`` (32 bits) ``value``: the shortest
    decimal that reads back as that float32 (0.1 arrives as 0.10000000149011612: the budget
    would round otherwise than in-process, and the combination key would be another)."""
    bits = struct.pack("<f", value)
    for digits in range(1, 10):  # 9 significant digits tell every float32 apart
        near = float(f"{value:.{digits}g}")
        if struct.pack("<f", near) == bits:
            return near
    return value


def token_ids(request: pb.BlendRequest, model: Any, tok: Any) -> list[list[int]]:
    """Each piece's token ids (a text's tokenized by ``tok``), every one in ``model``'s
    vocabulary (an id past it would index past the embeddings). Their count is checked
    against the model's context before any text is tokenized, and again after each text is;
    a text longer than ``MAX_CHARS_PER_TOKEN`` characters a token of the context left is
    refused before it is tokenized."""
    vocabulary, context = prompt_limits(model)

    def fits(tokens: int) -> None:
        if context is not None and tokens > context:
            raise InvalidArgument(f"Blend of {tokens} tokens exceeds the model's context of "
                                  f"{context} (max_position_embeddings)")

    total = sum(len(p.token_ids) for p in request.pieces)
    fits(total)
    out: list[list[int]] = []
    for j, p in enumerate(request.pieces):
        ids = list(p.token_ids)
        if ids and p.text:
            raise InvalidArgument(f"piece {j} has both token_ids and text; give one")
        if p.text:
            if tok is None:
                raise InvalidArgument(f"piece {j}: text given but this server has no tokenizer")
            if context is not None and len(p.text) > (context - total) * MAX_CHARS_PER_TOKEN:
                raise InvalidArgument(
                    f"piece {j}: a text of {len(p.text)} characters can not fit the "
                    f"{context - total} tokens left of the model's context of {context} "
                    f"(max_position_embeddings; at most {MAX_CHARS_PER_TOKEN} characters a "
                    f"token)")
            ids = tokenize(tok, p.text, f"piece {j}'s text")
            total += len(ids)
            fits(total)
        if not ids:
            raise InvalidArgument(f"piece {j} has neither token_ids nor text")
        check_vocabulary(ids, vocabulary, f"piece {j}")
        out.append(ids)
    return out
