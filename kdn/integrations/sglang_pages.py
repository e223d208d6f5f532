"""SGLang host-pool pages as kdn entries: views of the host pool's pages, and their codec.

Lifecycle: ``KDNHiCacheStorage.register_mem_pool_host`` builds one ``HostPages`` over SGLang's
host KV pool (``kdn.integrations.sglang``); from then on its batches take page views from it
(``pool_page``, ``flat_page``), encode pages to store (``encode``) and decode fetched entries
into page views (``place``), from the backend's worker threads.

A page view is ``[2, L, H, P, D]`` (K and V; layers; KV heads; the page's ``P`` tokens; head
dim) over the pool's memory, whichever of ``LAYOUTS`` the pool keeps, so the stored bytes do
not depend on the pool's layout. A page is a kdn ``KVCache`` of ``P`` tokens (K and V ``[H, P,
D]`` per layer) encoded in the backend's codec mode and level.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from kdn import codec
from kdn.cache import KVCache
from kdn.client.received import Fetched
from kdn.codec.format import RECORD_BYTES, check_frame, check_frame_prefix, record_prefix
from kdn.errors import InvalidArgument, KDNError
from kdn.layout import DType, KVLayout, LayerLayout, model_fingerprint

LAYOUTS = ("layer_first", "page_first", "page_first_direct")
"""Host pool layouts whose pages this backend reads and writes."""
_INT_VIEW = {2: np.int16, 4: np.int32}
"""Integer dtype of each element size: numpy views raw bodies as these, torch as the pool's
dtype (numpy has no bfloat16)."""


class HostPages:
    """The pages of one SGLang MHA host pool (``MHATokenToKVPoolHost``) and their codec."""

    def __init__(self, pool: Any, *, model_name: str, weights_id: str, mode: str,
                 level: str, scope: str = "") -> None:
        """``scope``: the engine's ``keys.scope_tag`` (adapter and salt), stored as the first
        path part of the layout's informational model name (``scope-<tag>/<model>``; the
        fingerprints and keys do not read it): the backend's ``clear`` deletes only its own
        scope's pages, and ``kdn admin ls --model`` still matches the model's last part."""
        if pool.layout not in LAYOUTS:
            raise NotImplementedError(
                f"host pool layout {pool.layout!r}: kdn reads and writes {list(LAYOUTS)}")
        v_dim = int(getattr(pool, "v_head_dim", pool.head_dim))
        buf = pool.kv_buffer
        if not isinstance(buf, torch.Tensor) or buf.dim() < 5 or buf.shape[0] != 2 \
                or v_dim != pool.head_dim:
            raise NotImplementedError(
                "kdn's HiCache backend needs an MHA host pool with one kv_buffer [2, ...] "
                "(K and V of equal head dim)")
        fp = model_fingerprint({"engine": "sglang", "model": model_name}, weights_id=weights_id)
        layers = tuple(LayerLayout(int(pool.head_num), int(pool.head_dim), v_dim)
                       for _ in range(int(pool.layer_num)))
        name = f"scope-{scope}/{model_name}" if scope else model_name
        self.layout = KVLayout(fp, layers, dtype=DType.of(pool.dtype),
                               head_dim=int(pool.head_dim), model_name=name)
        """The kdn layout of a page (model, layers, heads, head dim, dtype)."""
        self.page_size = int(pool.page_size)
        """Tokens per page (``P``)."""
        self.pool = pool
        self.mode = mode
        self.level = level
        lay, item = layers[0], self.layout.dtype.itemsize
        self._k_bytes = lay.kv_heads * self.page_size * lay.k_channels * item
        """Bytes of one layer's K body in a ``raw`` record (V's are as many: equal dims)."""
        self._record = np.frombuffer(
            record_prefix(lay, self.page_size, 2 * self._k_bytes), dtype=np.uint8)
        """The shape prefix every layer record of a ``raw`` page holds (``_place_verbatim``
        compares a frame's records with it at once)."""

    @property
    def slots(self) -> int:
        """Token slots of the host pool (pages × ``P``), from its ``kv_buffer``'s shape."""
        shape = self.pool.kv_buffer.shape
        if self.pool.layout == "layer_first":  # [2, L, size, H, D]
            return int(shape[2])
        if self.pool.layout == "page_first":  # [2, size, L, H, D]
            return int(shape[1])
        return int(shape[1]) * self.page_size  # page_first_direct: [2, pages, L, P, H, D]

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in the host pool (K and V, every layer)."""
        return self.layout.bytes_per_token * self.page_size

    def pool_page(self, index: int) -> torch.Tensor:
        """The page at token slot ``index`` of the host pool as a view ``[2, L, H, P, D]``."""
        pool = self.pool
        buf, p = pool.kv_buffer, self.page_size
        if pool.layout == "layer_first":  # [2, L, size, H, D]
            return buf[:, :, index : index + p].transpose(2, 3)
        if pool.layout == "page_first":  # [2, size, L, H, D]
            return buf[:, index : index + p].permute(0, 2, 3, 1, 4)
        return buf[:, index // p].transpose(2, 3)  # page_first_direct: [2, pages, L, P, H, D]

    def flat_page(self, flat: torch.Tensor) -> torch.Tensor:
        """A flat page in the pool's own order (``get_data_page(flat=True)``, SGLang's copying
        paths' values and targets) as a view ``[2, L, H, P, D]``."""
        pool = self.pool
        lay = self.layout
        n, h, d, p = lay.num_layers, lay.layers[0].kv_heads, lay.head_dim, self.page_size
        if flat.numel() != 2 * n * p * h * d:
            raise ValueError(f"page tensor has {flat.numel()} elements, a page has "
                             f"{2 * n * p * h * d}")
        if pool.layout == "page_first":
            return flat.view(2, p, n, h, d).permute(0, 2, 3, 1, 4)
        return flat.view(2, n, p, h, d).transpose(2, 3)

    def new_flat_page(self) -> torch.Tensor:
        lay = self.layout
        n, h, d = lay.num_layers, lay.layers[0].kv_heads, lay.head_dim
        return torch.empty(2 * n * self.page_size * h * d, dtype=lay.dtype.torch)

    def _cache(self, page: torch.Tensor) -> KVCache:
        """A page view ``[2, L, H, P, D]`` as a KVCache of views (no copy)."""
        return KVCache(self.layout, [(page[0, i], page[1, i]) for i in range(page.shape[1])])

    def encode(self, page: torch.Tensor) -> codec.EncodedParts:
        """Encode a page view ``[2, L, H, P, D]``; a view of another token count (a page cut
        short by the pool's end) is refused, never stored under a page's key."""
        if page.dim() != 5 or page.shape[3] != self.page_size:
            raise InvalidArgument(f"page view of shape {list(page.shape)} does not hold "
                                  f"{self.page_size} tokens")
        # raw: one frame per page (a page is read whole, and each frame costs a structure
        # check and two strided copies on its way into the pool); the other modes decode a
        # frame's layers in turn, so their frames stay small enough to decode side by side
        whole = len(self.layout.layers) if self.mode == "raw" else 0
        return codec.encode_parts(self._cache(page), self.mode, self.level,
                                  layers_per_frame=whole)

    def place(self, got: Fetched, page: torch.Tensor) -> None:
        """Decode one fetched entry (checksums verified) into a page view ``[2, L, H, P, D]``."""
        dec = codec.StreamDecoder(got.parsed(), borrow=got.owned, checked=got.checked,
                                  private=got.private)
        if dec.header.tokens != self.page_size or \
                dec.header.layout.fingerprint != self.layout.fingerprint:
            raise KDNError(f"entry holds {dec.header.tokens} tokens of layout "
                           f"{dec.header.layout.fingerprint}, not a page of this pool")
        n = page.shape[1]
        if dec.mode.name == "raw" and self._place_verbatim(dec, got, page):
            return
        ks: list[torch.Tensor | None] = [None] * n
        vs: list[torch.Tensor | None] = [None] * n
        for i, frame in enumerate(got.parts.frames):
            for layer, k, v in dec.decode_frame(i, frame):
                ks[layer], vs[layer] = k, v
        if any(t is None for t in ks):
            raise KDNError(f"entry does not decode every one of the page's {n} layers")
        # one contiguous [2, L, H, P, D] staging copy, then one strided copy into the pool:
        # two copies instead of two per layer (at a page's size the per-call cost outweighs
        # the bytes)
        page.copy_(torch.stack(ks + vs).view(page.shape))  # type: ignore[arg-type]

    def _place_verbatim(self, dec: codec.StreamDecoder, got: Fetched, page: torch.Tensor
                        ) -> bool:
        """A ``raw`` page straight from its frames into the pool: every frame's records are
        checked (structure, and checksums unless the server checked these bytes), then its
        layers' K and V bodies are copied as two strided views per frame, with no tensor per
        layer. False (nothing written) where records are not element-aligned (fp32 records:
        the general path decodes them)."""
        lay = self.layout
        item, kb = lay.dtype.itemsize, self._k_bytes
        rec = RECORD_BYTES + 2 * kb
        if rec % item:
            return False
        heads, p, d = lay.layers[0].kv_heads, self.page_size, lay.head_dim
        views = []
        for i, frame in enumerate(got.parts.frames):
            # the frame as a whole is checked here, its records all at once below (a page's
            # frame holds every layer: one byte comparison with the page's record prefix
            # instead of a loop over them)
            payload, first, count = check_frame_prefix(dec.header, i, frame,
                                                       checksum=not got.checked)
            body = np.frombuffer(payload, dtype=np.uint8)
            if len(body) != rec * count:
                check_frame(dec.header, i, frame, checksum=False)  # says what is wrong
                return False
            rows = body.reshape(count, rec)  # [layers, record]
            if not (rows[:, :RECORD_BYTES] == self._record).all():
                check_frame(dec.header, i, frame, checksum=False)  # raises, naming the layer
                return False
            views.append((first, count, rows))
        as_int, as_torch = _INT_VIEW[item], lay.dtype.torch
        with warnings.catch_warnings():  # read-only bytes: torch says it can not protect
            warnings.simplefilter("ignore", UserWarning)  # them; they are copy sources only
            bodies = [(first, count,
                       torch.from_numpy(rows[:, RECORD_BYTES : RECORD_BYTES + kb].view(as_int)),
                       torch.from_numpy(rows[:, RECORD_BYTES + kb :].view(as_int)))
                      for first, count, rows in views]
        for first, count, k, v in bodies:
            page[0, first : first + count].copy_(k.view(as_torch).view(count, heads, p, d))
            page[1, first : first + count].copy_(v.view(as_torch).view(count, heads, p, d))
        return True
