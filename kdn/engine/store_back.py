"""The engine's save side: a request's newly computed blocks stored on a background thread.

Lifecycle, per request (``KDNEngine.save_layer`` calls it):

1. ``to_host(k, v, first, last)`` for each layer: the tokens of the blocks kdn lacks, in host
   memory (on a GPU, non-blocking copies into pinned buffers on a side stream, so decode goes
   on while they travel);
2. ``start(ids, snapshot, first_block, rewrite, loaded)`` once every layer is in: a thread
   looks the blocks up and stores those the server lacks in each of the engine's encodings
   (a copy in the client's in-process tier serves no other process: it does not count). It is one
   of the object's ``pending`` threads until it ends. Blocks computed over a prefix that was
   loaded in a lossy encoding (``loaded``: ``kdn-*``, ``int8``, ``cachegen``) are not the
   model's exact KV: they are stored in the lossy encodings only, so that what ``raw`` and
   ``lossless`` hold is always exact (a later exact hit would carry the approximation on).
   The blocks' keys carry ``start``'s ``extras``: what their KV depends on beyond the ids, a
   LongRoPE model's prompt length (``kdn.model.hf.length_regime``).

Stores are best effort: a failure is logged and never reaches a request; once a store finds
the server unreachable or too slow (Unavailable, DeadlineExceeded) or the client closed
(Closed), the request's remaining blocks are dropped with one warning, not each tried in turn;
a block refused as too large (TooLarge: past the server's entry limit or the tenant's quota,
not RateLimited) ends the stores of its encoding (the others are as large). The threads are
daemons (a server that hangs must not hang the process's exit), so the process waits for them
explicitly: ``join`` (``KDNEngine.close``, or leaving ``with KDNEngine(...)``), and at
interpreter exit a hook joins every live ``StoreBack``'s pending threads for at most
``EXIT_WAIT_S`` seconds in all. The hook holds them weakly: it keeps no engine alive. It is one
of ``threading``'s exit hooks, which run before ``concurrent.futures`` stops taking work (the
codec's pools): an ``atexit`` hook runs after that, when every store would fail.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401  (its exit hook first, so ours runs before it)
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from kdn import keys
from kdn.cache import KVCache, LayerKV, to_pinned_host
from kdn.codec.catalog import EXACT_MODES
from kdn.codec.catalog import exact as exact_encoding
from kdn.delivery import encoding_name
from kdn.errors import Closed, DeadlineExceeded, RateLimited, TooLarge, Unavailable
from kdn.layout import KVLayout

log = logging.getLogger(__name__)

EXIT_WAIT_S = 30.0
"""At interpreter exit, how long the stores still running are waited for, all together."""

_LIVE: weakref.WeakSet[StoreBack] = weakref.WeakSet()


class StoreBack:
    """Stores blocks of ``chunk_tokens`` tokens of ``layout`` through ``client`` in each of
    ``encodings`` under ``namespace``; the lookup that finds those missing has a deadline of
    ``lookup_timeout_s``."""

    def __init__(self, client: Any, layout: KVLayout, chunk_tokens: int,
                 encodings: tuple[tuple[str, str], ...], namespace: str,
                 device: torch.device, lookup_timeout_s: float) -> None:
        self.client = client
        self.layout = layout
        self.chunk_tokens = chunk_tokens
        self.encodings = encodings
        self.namespace = namespace
        self.device = device
        self.lookup_timeout_s = lookup_timeout_s
        self._copies = (torch.cuda.Stream(device) if device.type == "cuda"
                        else None)  # device-to-host copies, off the decode stream
        self._pending: set[threading.Thread] = set()
        self._lock = threading.Lock()
        _LIVE.add(self)

    @property
    def pending(self) -> list[threading.Thread]:
        """The store threads not yet ended."""
        with self._lock:
            return list(self._pending)

    def to_host(self, k: torch.Tensor, v: torch.Tensor, first: int, last: int) -> LayerKV:
        """Tokens ``first..last`` of a layer's k, v ([kv_heads, tokens, channels]) in host
        memory: on a GPU non-blocking copies into pinned buffers on a side stream, ordered
        after the compute that made them (``start`` makes the thread wait for them)."""
        k, v = k[:, first:last], v[:, first:last]
        if self._copies is None:
            return k, v
        hk, hv = to_pinned_host((k, v), self._copies)
        return hk, hv

    def start(self, ids: list[int], snapshot: list[LayerKV], first_block: int,
              rewrite: str = "", loaded: str = "", extras: Sequence[bytes] = ()
              ) -> threading.Thread:
        """Store blocks ``first_block..`` of ``ids`` on a new pending thread; ``snapshot``:
        their layers from ``to_host`` (token 0 of it is token ``first_block *
        chunk_tokens``); ``rewrite``: an encoding whose blocks failed to load, stored again
        even where present (a damaged block, or one of another shape under its key, is
        mended); ``loaded``: the encoding blocks ``..first_block`` came in (a lossy one
        leaves the exact encodings out); ``extras``: those of the request's chain keys
        (``keys.prefix_keys``)."""
        ready = None
        if self._copies is not None:
            ready = torch.cuda.Event()
            ready.record(self._copies)
        thread = threading.Thread(target=self._run,
                                  args=(ids, snapshot, first_block, ready, rewrite,
                                        self._exact_allowed(first_block, loaded),
                                        list(extras)),
                                  daemon=True, name="kdn-store-back")
        with self._lock:
            self._pending.add(thread)
        try:
            thread.start()
        except BaseException:
            with self._lock:
                self._pending.discard(thread)
            raise
        return thread

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the pending stores, at most ``timeout`` seconds in all (None: no bound);
        True when none is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self.pending:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return not self.pending

    @staticmethod
    def _exact_allowed(first_block: int, loaded: str) -> bool:
        """Whether blocks computed after ``first_block`` loaded blocks in ``loaded`` are exact."""
        return first_block == 0 or exact_encoding(loaded)

    def _run(self, ids: list[int], snapshot: list[LayerKV], first_block: int, ready: Any,
             rewrite: str, exact: bool, extras: list[bytes]) -> None:
        try:
            self._store(ids, snapshot, first_block, ready, rewrite, exact, extras)
        except Exception:  # best effort: whatever went wrong is logged, never raised
            log.exception("store-back failed")
        finally:
            with self._lock:
                self._pending.discard(threading.current_thread())

    def _store(self, ids: list[int], snapshot: list[LayerKV], first_block: int, ready: Any,
               rewrite: str, exact: bool, extras: list[bytes]) -> None:
        if ready is not None:
            ready.synchronize()
        c, ns = self.chunk_tokens, self.namespace
        base = first_block * c
        chain = keys.prefix_keys(ids, self.layout, ns, c, extras=extras)
        todo = [(b, mode, level, keys.variant_key(chain[b], encoding_name(mode, level)))
                for b in range(first_block, len(chain)) for mode, level in self.encodings
                if exact or mode not in EXACT_MODES]
        if not todo:
            return
        try:
            present = self.client.lookup([t[3] for t in todo], namespace=ns, server_only=True,
                                         timeout_s=self.lookup_timeout_s).infos
        except Exception as exc:  # storing back is best effort; generation goes on
            log.warning("store-back lookup failed: %s", exc)
            return
        dt = self.layout.dtype.torch
        refused: set[str] = set()  # encodings whose blocks the server refused as too large
        for j, ((b, mode, level, key), info) in enumerate(zip(todo, present)):
            name = encoding_name(mode, level)
            if (info.present and name != rewrite) or name in refused:
                continue
            lo = b * c - base
            layers = [(k[:, lo : lo + c].to(dt), v[:, lo : lo + c].to(dt)) for k, v in snapshot]
            kv = KVCache(self.layout, layers, start_position=b * c)
            try:
                self.client.store(key, kv, mode=mode, level=level, namespace=ns)
            except (Unavailable, DeadlineExceeded, Closed) as exc:  # the rest would fail too
                left = sum(1 for (_, m, lv, _), i in zip(todo[j + 1 :], present[j + 1 :])
                           if not i.present or encoding_name(m, lv) == rewrite)
                why = ("the client was closed" if isinstance(exc, Closed)
                       else "the server does not answer")
                log.warning("store-back of block %d (%s) failed: %s; %s, so the request's %d "
                            "other stores are dropped", b, mode, exc, why, left)
                return
            except TooLarge as exc:
                if isinstance(exc, RateLimited):  # for now: the next block may be taken
                    log.warning("store-back of block %d (%s) failed: %s", b, mode, exc)
                    continue
                refused.add(name)  # its other blocks are as large: refused as well
                log.warning("store-back of block %d (%s) failed: %s; the request's other "
                            "blocks in %s are not sent", b, mode, exc, name)
            except Exception as exc:  # storing back is best effort; generation goes on
                log.warning("store-back of block %d (%s) failed: %s", b, mode, exc)


def _join_at_exit() -> None:
    """Join every live ``StoreBack``'s pending stores, ``EXIT_WAIT_S`` seconds at most."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for saver in list(_LIVE):
        if not saver.join(max(0.0, deadline - time.monotonic())):
            log.warning("kdn: %d store-back thread(s) still running at exit; their blocks "
                        "are not stored", len(saver.pending))


_at_thread_exit = getattr(threading, "_register_atexit", atexit.register)
_at_thread_exit(_join_at_exit)  # run in reverse order: before concurrent.futures' own
