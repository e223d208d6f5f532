"""The Blend RPC: a server that hosts a model composes stored chunks and text into one prompt's KV.

Lifecycle of ``Blend(request)``:

1. the model named by ``ServerConfig.model`` is loaded on first use (``kdn.models.load_model``;
   memoised); a server without one answers FAILED_PRECONDITION;
2. text pieces are tokenized (or taken as ids); each chunk piece's ids must hash to its key
   (``kdn.keys.chunk_key`` under the chunk's stored layout), so the KV and the ids agree;
3. with ``store`` set, the combination's key (``kdn.blend.key.combination_key``) is looked up
   first: a repeated combination is served from the store like a Retrieve (tier = the tier it
   was read from);
4. otherwise every chunk entry is read once, and ``kdn.blend.blend`` runs on a worker thread,
   decoding each chunk's layer from the stored frames right before the blend loop needs it;
   one blend runs at a time per server (the model is shared);
5. the result is encoded (``mode``/``level``, default lossless), stored under the combination
   key when asked, and streamed back as a Retrieve stream: header (tier ``blend``), then frames.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import grpc

from kdn import codec
from kdn.blend import BlendConfig, Piece, blend
from kdn.blend.key import combination_key
from kdn.cache import LayerKV
from kdn.codec.format import Header, check_frame, parse_header, split_frames
from kdn.engine.engine import model_layout
from kdn.errors import InvalidArgument, KDNError, LayoutMismatch, NotFound, grpc_code
from kdn.keys import check_key, check_namespace, chunk_key
from kdn.layout import DType, KVLayout
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.server.config import ServerConfig
    from kdn.store.tiered import TieredStore


class NoModel(KDNError):
    """This server hosts no model, so it can not blend."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class StoredChunk:
    """A stored entry as a blend ``LayerSource``: frame f is decoded when a layer in it is asked."""

    def __init__(self, value: bytes) -> None:
        self.header: Header = parse_header(value)
        self.frames = list(split_frames(value, len(self.header.raw)))
        self.decoder = codec.StreamDecoder(self.header)
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


class BlendMixin:
    """``Blend`` for ``KDNServicer`` (which provides ``config``, ``store`` and ``count``)."""

    if TYPE_CHECKING:
        config: ServerConfig
        store: TieredStore

        def count(self, name: str, n: int = 1) -> None: ...

    _blend_lock = threading.Lock()
    blend_model: tuple[Any, Any] | None = None
    """(model, tokenizer) to blend with, set by whoever builds the server in-process; when None
    the model named by ``config.model`` is loaded on first use."""

    def _blend_model(self) -> tuple[Any, Any]:
        if self.blend_model is not None:
            return self.blend_model
        name = str(getattr(self.config, "model", "") or "")
        if not name:
            raise NoModel("this server hosts no model (set `model` in its config) and can not "
                          "blend")
        from kdn.models import load_model

        return load_model(name)

    def _plan(self, request: pb.BlendRequest) -> tuple[Any, list[Piece], BlendConfig, bytes,
                                                        str, str]:
        """(model, pieces, blend config, store key or b"", mode, level); runs on a thread."""
        ns = check_namespace(request.namespace or "default")
        if not request.pieces:
            raise InvalidArgument("Blend needs at least one piece")
        model, tok = self._blend_model()
        default = BlendConfig()
        cfg = BlendConfig(
            ratio=request.ratio if request.HasField("ratio") else default.ratio,
            select_layer=request.select_layer or default.select_layer,
            head_tokens=request.head_tokens, per_chunk=request.per_chunk,
            query_share=(request.query_share if request.HasField("query_share")
                         else default.query_share))
        mode = request.mode or "lossless"
        codec.get_mode(mode).check_level(request.level)
        from kdn.server.service import store_key

        fingerprint = model_layout(model, DType.FLOAT32).model_fingerprint
        pieces: list[Piece] = []
        named: list[tuple[bytes, list[int]]] = []
        layout: KVLayout | None = None
        for j, p in enumerate(request.pieces):
            ids = list(p.token_ids)
            if not ids and p.text:
                if tok is None:
                    raise InvalidArgument(f"piece {j}: text given but this server has no tokenizer")
                ids = tok(p.text, add_special_tokens=False)["input_ids"]
            if not ids:
                raise InvalidArgument(f"piece {j} has neither token_ids nor text")
            if not p.chunk_key:
                pieces.append(Piece(ids))
                named.append((b"", ids))
                continue
            hit = self.store.get(store_key(ns, check_key(p.chunk_key)))
            if hit is None:
                raise NotFound(f"piece {j}: no chunk {p.chunk_key.hex()} in {ns!r}")
            src = StoredChunk(bytes(hit.value))
            if src.layout.model_fingerprint != fingerprint:
                raise LayoutMismatch(f"piece {j}: chunk belongs to model "
                                     f"{src.layout.model_fingerprint}, this server runs "
                                     f"{fingerprint}")
            if chunk_key(ids, src.layout, ns) != p.chunk_key:
                raise InvalidArgument(f"piece {j}: token_ids do not match chunk_key")
            layout = layout or src.layout
            pieces.append(Piece(ids, src))
            named.append((bytes(p.chunk_key), ids))
        layout = layout or model_layout(model, DType.FLOAT32)
        want = request.expect_layout_fingerprint
        if want and want != layout.fingerprint:
            raise LayoutMismatch(f"blend result has layout {layout.fingerprint}, caller expects "
                                 f"{want}")
        encoding = mode if not request.level else f"{mode}-{request.level}"
        skey = (store_key(ns, combination_key(named, layout.fingerprint, cfg, ns, encoding))
                if request.store else b"")
        return model, pieces, cfg, skey, mode, request.level

    def _compute(self, model: Any, pieces: list[Piece], cfg: BlendConfig, mode: str,
                 level: str) -> codec.EncodedParts:
        with self._blend_lock:
            result = blend(model, pieces, cfg)
        return codec.encode_parts(result.kv, mode, level)

    async def Blend(self, request: pb.BlendRequest,
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.RetrieveResponse]:
        try:
            model, pieces, cfg, skey, mode, level = await asyncio.to_thread(self._plan, request)
            hit = await asyncio.to_thread(self.store.get, skey) if skey else None
            if hit is not None:
                self.count("blend.hit")
                header = parse_header(hit.value)
                head, tier = bytes(header.raw), hit.tier
                frames = [bytes(f) for f in split_frames(hit.value, len(header.raw))]
            else:
                parts = await asyncio.to_thread(self._compute, model, pieces, cfg, mode, level)
                head, frames, tier = parts.header, [bytes(f) for f in parts.frames], "blend"
                if skey:
                    await asyncio.to_thread(self.store.put, skey, parts.to_bytes())
                self.count("blend.computed")
        except KDNError as exc:
            self.count(f"Blend.{grpc_code(exc).name}")
            await context.abort(grpc_code(exc), str(exc))
            return
        total = len(head) + sum(len(f) for f in frames)
        yield pb.RetrieveResponse(header=pb.RetrieveHeader(
            container_header=head, total_bytes=total, tier=tier, frame_count=len(frames)))
        for i, frame in enumerate(frames):
            yield pb.RetrieveResponse(frame=pb.Frame(index=i, data=frame))
        self.count("blend.frames_sent", len(frames))
