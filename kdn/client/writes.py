"""The writes of ``kdn.client.Client`` beside ``store``/``store_many``: staged entries
(``stage``, ``kdn.client.staged``) and asynchronous stores (``store_async``, ``flush``), and
the helpers every store shares (how an entry is encoded, its options on the wire)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeGuard, cast

from kdn import codec
from kdn.client.puts import PendingStore
from kdn.codec import EncodedParts
from kdn.keys import check_key
from kdn.layout import KVLayout
from kdn.options import StoreOptions
from kdn.v1 import kdn_pb2 as pb

if TYPE_CHECKING:
    from kdn.cache import KVCache
    from kdn.client.dataplane import DataPlane
    from kdn.client.staged import Staged


class WritesMixin:
    """``Client``'s staged and asynchronous stores (it provides ``dataplane``, ``local``,
    ``store``, ``_ns`` and ``_remember``)."""

    if TYPE_CHECKING:
        dataplane: DataPlane
        local: Any
        store: Any

        def _ns(self, namespace: str | None) -> str: ...

        def _remember(self, namespace: str, key: bytes, parts: EncodedParts) -> None: ...

    def store_async(
        self,
        key: bytes,
        kv: KVCache | EncodedParts | Staged,
        *,
        mode: str = "lossless",
        level: str = "",
        namespace: str | None = None,
        options: StoreOptions | None = None,
        layers_per_frame: int = 0,
    ) -> PendingStore:
        """``store`` without waiting for the server's answer (as LMCache's put and vLLM's
        asynchronous save do): on the server's host the entry is written into the segment (a
        staged entry: named where it lies) and the call sent on this thread's fast-path
        connection; on another host its bytes go on this thread's network data path
        connection; at most ``ASYNC_DEPTH`` unanswered either way. Without either path, or
        without room, it is stored as ``store`` does and comes back answered. The server
        checks it as any store. Its answer is read by ``result()``, by this thread's next
        call of this client (every call waits for the thread's earlier stores first, so its
        reads see them), or by ``flush()``, which raises the first error since the last flush.
        A staged entry must not be written again until its store is answered (the server
        copies what it holds then)."""
        check_key(key)
        ns = self._ns(namespace)
        opts = _wire_options(options)
        parts: EncodedParts | None = None
        if _is_staged(kv) and self.local is None and self.dataplane.segment()[0] is not None \
                and self.dataplane.server_seals:
            got = self.dataplane.put_async(ns, key, opts, staged=kv)
        else:
            parts = kept = _encoded(kv, mode, level, layers_per_frame)
            on_ok = None if self.local is None else lambda: self._remember(ns, key, kept)
            got = self.dataplane.put_async(ns, key, opts, parts=parts, on_ok=on_ok)
            if got is None and self.dataplane.segment()[0] is None:  # another host
                got = self.dataplane.put_async_net(ns, key, opts, parts, on_ok=on_ok)
        if got is None:
            return PendingStore.answered(key, self.store(
                key, parts if parts is not None else kv, namespace=ns, options=options))
        return got

    def flush(self) -> None:
        """Wait for this thread's asynchronous stores (``store_async``); raise the first error
        among those answered since the last flush (each also raises from its ``result()``)."""
        self.dataplane.settle_async()
        errors = self.dataplane.take_async_errors()
        if errors:
            raise errors[0]

    def _settle(self) -> None:
        """Read this thread's asynchronous stores' answers before another call (its errors
        are kept for ``flush``)."""
        if self.dataplane.has_pending():
            self.dataplane.settle_async()

    def stage(self, layout: KVLayout, tokens: int, *, start_position: int = 0) -> Staged:
        """A ``raw`` entry of ``tokens`` tokens of ``layout`` to fill in place and store without
        this client copying or hashing it (``kdn.client.staged``): in the shared segment on the
        server's host (registered with CUDA on a CUDA host), else in this process's memory."""
        from kdn.client.staged import Staged

        seg = self.dataplane.segment()[0]
        if seg is not None:
            seg.register_with_cuda()  # once; nothing where CUDA is not available
        return Staged(layout, tokens, start_position, seg)

    def _store_staged(self, ns: str, items: Sequence[tuple[bytes, Staged]],
                      options: StoreOptions | None, request_id: str | None
                      ) -> list[pb.StoreResponse]:
        from kdn.client.staged import store_staged

        return store_staged(self, ns, items, _wire_options(options), options, request_id)


def _is_staged(kv: object) -> TypeGuard[Staged]:
    """Whether ``kv`` is a ``kdn.client.staged.Staged`` (none exists before that module, which
    needs torch, was imported)."""
    mod = sys.modules.get("kdn.client.staged")
    return mod is not None and isinstance(kv, mod.Staged)


def _encoded(kv: KVCache | EncodedParts | Staged, mode: str, level: str,
             layers_per_frame: int) -> EncodedParts:
    if isinstance(kv, EncodedParts):
        return kv
    if _is_staged(kv):  # sealed on its own bytes (the segment's way is ``_store_staged``)
        return kv.sealed()
    return codec.encode_parts(cast("KVCache", kv), mode, level,
                              layers_per_frame=layers_per_frame, wire=True)


def _wire_options(options: StoreOptions | None) -> pb.StoreOptions:
    opts = options or StoreOptions()
    return pb.StoreOptions(ttl_seconds=opts.ttl_s, pin=opts.pin,
                           durability=int(opts.durability))  # type: ignore[arg-type]
