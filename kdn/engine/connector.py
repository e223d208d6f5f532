"""The connector protocol: how an inference engine loads KV from kdn and saves KV into it.

Shaped like vLLM's KV connector (``vllm/distributed/kv_transfer/kv_connector/v1/base.py``):
this is the interface a vLLM or SGLang connector wraps, and the one kdn's own engine
(``kdn.engine.KDNEngine``) and the blender's chunk source (``kdn.blend.chunks.ChunkConnector``) use.
Everything is per request, one request at a time per connector object.

Lifecycle of one request, and who calls what:

1. ``matched_tokens(token_ids)`` (the scheduler, before allocating cache room): how many
   leading tokens of the prompt kdn can supply. A read-only lookup: no side effects, nothing
   is fetched or reserved, and asking twice gives the same answer while the store is unchanged.
2. ``start_load(token_ids)`` (the worker, before the forward pass): begins fetching what is
   available, asynchronously, and returns how many leading tokens will be loaded (0: compute
   everything; may be less than ``matched_tokens`` said, e.g. when recomputing is faster or an
   entry was evicted meanwhile).
3. ``wait_for_layer(i)`` (the model's layer i, right before it attends): blocks until layer i's
   K/V of the loaded tokens are usable and returns them, ``k: [kv_heads, tokens, k_channels]``,
   ``v: [kv_heads, tokens, v_channels]``; later layers keep arriving meanwhile.
4. ``save_layer(i, k, v)`` (the worker, after the forward that produced the first token):
   hands over layer i's K/V of the whole prompt so far, same shapes. Saving starts once every
   layer is in; it never delays the first token. Optional: the default does nothing.
5. ``wait_for_save()`` (the worker, before the cache memory is reused): blocks until the saves
   of this request are done. Optional: the default returns at once.
6. ``finish()``: the request is over; a load still running is cancelled. Optional.

Failures while loading raise from ``wait_for_layer`` (the engine then recomputes); failures
while saving are logged and never reach the request: a save is best effort.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

import torch

from kdn.cache import LayerKV
from kdn.layout import KVLayout


class KVConnector(abc.ABC):
    """Loads a prompt's leading KV from kdn layer by layer, and saves new KV back."""

    @property
    @abc.abstractmethod
    def layout(self) -> KVLayout:
        """The layout of the KV this connector loads and saves."""

    @abc.abstractmethod
    def matched_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` available in kdn (read-only)."""

    @abc.abstractmethod
    def start_load(self, token_ids: Sequence[int]) -> int:
        """Begin loading; the number of leading tokens that will be loaded (0: none)."""

    @abc.abstractmethod
    def wait_for_layer(self, i: int, timeout: float | None = None) -> LayerKV:
        """Layer i's (K, V) of the loaded tokens, once usable."""

    def save_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:  # noqa: B027
        """Layer i's (K, V) of the prompt, to store once every layer is in (optional hook)."""

    def wait_for_save(self, timeout: float | None = None) -> None:  # noqa: B027
        """Block until this request's saves are done (optional hook)."""

    def finish(self) -> None:  # noqa: B027
        """The request is over: cancel what is still loading (optional hook)."""
