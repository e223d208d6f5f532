"""One knowledge chunk's KV in kdn, as a connector and as a blend ``LayerSource``.

A chunk is prefilled alone from position 0 and stored under its position-free key
(``kdn.keys.chunk_key``), so it can be placed anywhere in a prompt by ``kdn.blend.blend``.
``ChunkConnector`` follows the connector protocol (``kdn.engine.connector``) for one chunk:

    chunk = ChunkConnector(client, layout, namespace="rag")
    if chunk.start_load(ids) == 0:                   # a miss: compute the chunk here
        kv, _ = kdn.model.hf.prefill(model, ids, layout)
        for i, (k, v) in enumerate(kv.layers):
            chunk.save_layer(i, k, v)                # usable by the blend at once
    result = blend(model, [Piece(head), Piece(ids, chunk), Piece(question)])
    chunk.wait_for_save()                            # stores a computed chunk (after the answer)

A chunk is all or nothing: ``matched_tokens`` is its length when kdn holds it, else 0; an
entry stored with its keys rotated elsewhere says so (``start_position``, from its header), and
the blend re-positions it from there. Layers
come from the Retrieve stream (decoded while the blend runs earlier layers) or, for a chunk
computed here, from the saved layers. Saving is deferred to ``wait_for_save`` so storing never
competes with the request for compute before the answer is out.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kdn.cache import KVCache, LayerKV
from kdn.client import Client
from kdn.client.stream import LayerStream
from kdn.engine.connector import KVConnector
from kdn.errors import InvalidArgument
from kdn.keys import chunk_key
from kdn.layout import KVLayout


class ChunkConnector(KVConnector):
    """One chunk (see the module docstring)."""

    def __init__(self, client: Client, layout: KVLayout, namespace: str, *,
                 mode: str = "lossless", level: str = "",
                 device: torch.device | str | None = None, salt: str = "") -> None:
        self.client = client
        self.device = device
        """Where loaded layers land (the model's device: a GPU blend gets them there)."""
        self._layout = layout
        self.namespace = namespace
        self.salt = salt
        """Salts the chunk's key (``kdn.keys.chunk_key``): "" for none."""
        self.mode, self.level = mode, level
        self.ids: list[int] = []
        self.key = b""
        self.stream: LayerStream | None = None
        self._saved: dict[int, LayerKV] = {}
        self.kv: KVCache | None = None
        """The chunk's KV when it was computed here (all layers saved)."""
        self.stored_bytes = 0
        """Bytes kdn holds for the chunk after ``wait_for_save`` stored it."""

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def num_tokens(self) -> int:
        return len(self.ids)

    @property
    def start_position(self) -> int:
        """Position the chunk's keys were rotated at: the stored entry's (its header's) when
        it was loaded, else 0 (a chunk computed here is prefilled alone from position 0).
        The blender re-positions the keys from it."""
        return self.stream.start_position if self.stream is not None else 0

    def key_of(self, token_ids: Sequence[int]) -> bytes:
        return chunk_key(token_ids, self.layout, self.namespace, salt=self.salt)

    def matched_tokens(self, token_ids: Sequence[int]) -> int:
        present = self.client.contains(self.key_of(token_ids), namespace=self.namespace)
        return len(token_ids) if present else 0

    def start_load(self, token_ids: Sequence[int]) -> int:
        self.ids = [int(t) for t in token_ids]
        self.key = self.key_of(self.ids)
        self.stream = self.client.retrieve_stream(self.key, namespace=self.namespace,
                                                  layout=self.layout, tokens=len(self.ids),
                                                  device=self.device)
        return len(self.ids) if self.stream is not None else 0

    def wait_for_layer(self, i: int, timeout: float | None = None) -> LayerKV:
        if self.stream is not None:
            return self.stream.wait_for_layer(i, timeout)
        if i in self._saved:
            return self._saved[i]
        raise InvalidArgument(f"chunk layer {i} was neither loaded nor saved")

    def save_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i of a chunk computed here; ``wait_for_save`` stores the whole chunk."""
        self._saved[i] = (k, v)
        if len(self._saved) == self.layout.num_layers:
            self.kv = KVCache(self.layout, [self._saved[j] for j in range(len(self._saved))])

    def wait_for_save(self, timeout: float | None = None) -> None:
        if self.kv is not None and not self.stored_bytes:
            resp = self.client.store(self.key, self.kv, mode=self.mode, level=self.level,
                                     namespace=self.namespace)
            self.stored_bytes = int(resp.stored_bytes)

    def finish(self) -> None:
        if self.stream is not None:
            self.stream.cancel()
