"""The scheduler half of kdn's vLLM connector (``kdn.integrations.vllm``).

Lifecycle of one request here:

1. ``matched(request, local_hit)`` (vLLM's ``get_num_new_matched_tokens``): the first call
   submits a ``_Lookup`` to a thread pool and answers None ("ask again later"); the pool hashes
   the request's chunks into keys (every TP rank's; with its adapter, images, prompt
   embeddings and salt: ``kdn.integrations.vllm_keys``), asks the server in one batched Lookup
   which of them it holds in each configured encoding, and lets the loading controller pick
   the encoding to load. Later calls answer from the finished lookup: the hit tokens beyond
   ``local_hit`` (0 when the server could not answer: the keys are still made, so the
   request's chunks are saved from chunk 0 on). Nothing here waits on the server. A lookup
   has ``lookup_timeout_s``; once one passes it, lookups answer 0 without asking for
   ``BACKOFF_TIMES`` that long (a silent server would hold each waiting request for its own
   deadline, ``lookup_threads`` at a time; a stopped one refuses at once). A failed lookup is
   a WARNING for the first of its kind, then one a minute (``kdn.ratelog.Outage``), and one
   INFO line when the server answers again.
2. ``allocated(request, block_ids, n)``: the lookup is consumed; with ``n > 0`` a ``LoadSpec``
   is queued for the next step. The request's ``_Tracked`` state (prompt length, keys, blocks,
   the next chunk to save) starts here.
3. ``build(scheduler_output)``: block tables follow the step's new and resumed requests; the
   queued loads, and a ``SaveSpec`` for each request's chunks that are complete by the end of
   the step and that kdn did not hold, go into the step's ``KDNConnectorMetadata``.
4. ``finished(req_id)``: the state is dropped.

``reset()`` (vLLM's ``reset_cache``, after a weight update) draws a random epoch that enters
every later key, so nothing stored before it is loaded again; lookups in flight and requests'
save plans are dropped (vLLM preempts running requests in such a reset; resumed, they are
looked up again under the new keys).

A preempted request loses its blocks (its block table restarts when vLLM resumes it) and is
looked up again when vLLM asks, so chunks it saved before the preemption are loaded back.

Blocks loaded in a lossy encoding, and those computed over them, are remembered until vLLM
hands them out anew: a request sharing any of them through vLLM's prefix cache stores its
chunks in the lossy encodings only (``SaveSpec.exact``), as one that loaded them itself.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kdn import keys
from kdn.client import Client
from kdn.client.deadline import deadline_within
from kdn.codec.catalog import exact
from kdn.delivery import NETWORK, RECOMPUTE, SAME_HOST, LoadingController
from kdn.errors import DeadlineExceeded
from kdn.integrations.vllm_keys import request_chains
from kdn.integrations.vllm_meta import (
    KDNConnectorConfig,
    KDNConnectorMetadata,
    LoadSpec,
    PagedShape,
    SaveSpec,
)
from kdn.ratelog import Outage

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


log = logging.getLogger(__name__)

BACKOFF_TIMES = 10
"""After a lookup timed out (a silent server), lookups answer misses at once for this many
``lookup_timeout_s``."""


@dataclass
class _Found:
    """A finished lookup."""

    chains: list[list[bytes]]
    """Per TP rank: base keys of every full chunk of the tokens looked up."""
    hit_chunks: int
    """Leading chunks stored (for every rank) in ``encoding``, capped so a token is left to
    compute."""
    encoding: str
    """The encoding the controller picked (``lossless``... or ``recompute``: load nothing)."""
    stored_chunks: int
    """Leading chunks stored in every configured encoding: saves start after them."""


@dataclass
class _Lookup:
    future: Future[_Found]
    local_hit: int = 0
    """vLLM's own prefix hit (tokens) at the latest ask."""


@dataclass
class _Tracked:
    prompt_len: int
    chains: list[list[bytes]]
    next_save: int
    """First chunk not yet saved (or found stored)."""
    block_ids: list[int] = field(default_factory=list)
    mend: bool = False
    """A load of its failed: its chunks are saved even where kdn holds them."""
    exact: bool = True
    """No chunk of it was loaded in a lossy encoding, nor does it share (vLLM's prefix cache)
    blocks another request loaded so (``SaveSpec.exact``)."""
    suspect_end: int = 0
    """Chunks ``next_save..suspect_end`` were saved in a step whose load failed (on some
    rank): wrong on any rank until stored again, and forgotten if it ends first."""


class SchedulerSide:
    """Lookups, load plans and save plans (module docstring)."""

    def __init__(self, shape: PagedShape, config: KDNConnectorConfig, client: Client, *,
                 load: bool, save: bool, own_client: bool = True) -> None:
        self.shape = shape
        self.client = client
        self.config = config
        self.load, self.save = load, save
        self.controller = LoadingController(prefill_tok_s=self.config.prefill_tok_s,
                                            layers=shape.layout.num_layers)
        self._pool = ThreadPoolExecutor(self.config.lookup_threads,
                                        thread_name_prefix="kdn-vllm-lookup")
        for _ in range(self.config.lookup_threads):  # threads started now, not on a first ask
            self._pool.submit(int)
        self._own_client = own_client
        self._lock = threading.Lock()
        self._lookups: dict[str, _Lookup] = {}
        self._tracked: dict[str, _Tracked] = {}
        self._loads: list[LoadSpec] = []
        self._forget: list[list[list[bytes]]] = []
        # blocks whose KV is not exact (loaded in a lossy encoding, or computed over such
        # blocks): a request sharing one through vLLM's prefix cache saves no exact encoding;
        # a block vLLM hands out anew (past a request's prefix hit) is written afresh
        self._lossy: set[int] = set()
        self._epoch = b""  # reset(): drawn anew, mixed into every key
        self._down_until = 0.0  # monotonic: lookups answer misses until then (BACKOFF_TIMES)
        self._outage = Outage(log, "kdn: the server answers lookups again")

    # -- lookups ------------------------------------------------------------------------------

    def _lookup(self, token_ids: list[int], request: Request, epoch: bytes) -> _Found:
        chains = request_chains(request, token_ids, self.shape, self.config, epoch)
        n = len(chains[0])
        usable = max(0, (len(token_ids) - 1) // self.shape.chunk_tokens)  # >= 1 token computed
        if not n:
            return _Found(chains, 0, RECOMPUTE, 0)
        if time.monotonic() < self._down_until:  # the server did not answer lately
            return _Found(chains, 0, RECOMPUTE, 0)
        encs = self.shape.encodings
        asked = [keys.variant_key(k, e) for e in encs for chain in chains for k in chain]
        try:
            with deadline_within(self.config.lookup_timeout_s):
                infos = self.client.lookup(asked, namespace=self.config.namespace).infos
            self._outage.answered()
        except Exception as exc:  # the server unreachable or failing: a miss, never an error;
            # the chains are known, so the chunks are still saved once computed
            self._failed_lookup(request.request_id, exc)
            return _Found(chains, 0, RECOMPUTE, 0)
        per = len(chains) * n  # one encoding's rows: every rank's chain
        lead: dict[str, int] = {}
        size: dict[str, int] = {}
        for j, e in enumerate(encs):
            rows = infos[j * per : (j + 1) * per]
            lead[e] = min(next((i for i, info in enumerate(rows[r * n : (r + 1) * n])
                                if not info.present), n) for r in range(len(chains)))
            size[e] = sum(info.size_bytes for r in range(len(chains))
                          for info in rows[r * n : r * n + lead[e]])
        stored = min(lead.values())
        best = min(max(lead.values()), usable)
        if not best or not self.load:
            return _Found(chains, 0, RECOMPUTE, stored)
        tokens = best * self.shape.chunk_tokens
        candidates = {e: size[e] for e in encs if lead[e] >= best}
        decision = self.controller.choose(tokens, tokens * self.shape.layout.bytes_per_token,
                                          candidates, path=self._path(),
                                          server=self.client.address)
        choice = decision.choice
        if choice == RECOMPUTE and not self.config.allow_recompute:
            choice = min(candidates, key=lambda e: decision.estimates_s[e])
        return _Found(chains, best if choice != RECOMPUTE else 0, choice, stored)

    def _failed_lookup(self, rid: str, exc: Exception) -> None:
        """A lookup failed: logged (``Outage``: once, then once a minute); where the server
        did not answer in time (stalled) lookups are not tried for a while. A refused
        connection (UNAVAILABLE) fails at once, as does a server's blip: no back-off."""
        if not isinstance(exc, (DeadlineExceeded, TimeoutError)):  # an answer, if an error
            self._outage.failed("kdn: lookup of request %s failed: %s", rid, exc,
                                kind=type(exc).__name__)
            return
        backoff = BACKOFF_TIMES * self.config.lookup_timeout_s
        with self._lock:
            self._down_until = time.monotonic() + backoff
        self._outage.failed("kdn: the server did not answer the lookup of request %s within "
                            "lookup_timeout_s (%.3g s): lookups answer misses for %.3g s at a "
                            "time (%s)", rid, self.config.lookup_timeout_s, backoff, exc)

    def _path(self) -> str:
        try:
            return SAME_HOST if self.client.dataplane.attached else NETWORK
        except Exception:  # not reachable now: the lookup said so already
            return NETWORK

    def matched(self, request: Request, local_hit: int) -> int | None:
        rid = request.request_id
        with self._lock:
            look = self._lookups.get(rid)
            if look is None:
                ids = list(request.all_token_ids)
                look = self._lookups[rid] = _Lookup(self._pool.submit(self._lookup, ids, request,
                                                                      self._epoch))
            look.local_hit = local_hit
        if not look.future.done():
            return None
        try:
            found = look.future.result()
        except Exception as exc:  # keys not made (a failing server is a _Found, no hit): a miss
            log.warning("kdn: lookup of request %s failed: %s", rid, exc)
            return 0
        return max(0, found.hit_chunks * self.shape.chunk_tokens - local_hit)

    def allocated(self, request: Request, block_ids: list[int], num_external: int) -> None:
        rid = request.request_id
        with self._lock:
            look = self._lookups.pop(rid, None)
        found = None
        if look is not None and look.future.done() and look.future.exception() is None:
            found = look.future.result()
        if found is None:
            if num_external:
                raise RuntimeError(f"request {rid}: {num_external} external tokens allocated "
                                   "without a finished kdn lookup")
            return
        prompt = request.num_prompt_tokens  # also of a prompt given as embeddings only
        tracked = self._tracked.get(rid)
        if tracked is None:
            tracked = self._tracked[rid] = _Tracked(prompt, found.chains, found.stored_chunks)
        else:  # resumed after a preemption: keys already known, saves go on where they were
            tracked.chains = found.chains
            tracked.next_save = max(tracked.next_save, found.stored_chunks)
        tracked.block_ids = list(block_ids)
        start = look.local_hit if look is not None else 0
        shared = start // self.shape.block_size  # blocks of vLLM's own prefix hit
        self._lossy.difference_update(block_ids[shared:])  # handed out anew: written afresh
        if num_external > 0:
            tracked.exact = tracked.exact and exact(found.encoding)
        if tracked.exact and not self._lossy.isdisjoint(block_ids[:shared]):
            tracked.exact = False  # it shares blocks another request loaded lossily
        if not tracked.exact:  # its own blocks; those it shares keep what they hold
            self._lossy.update(block_ids[shared:])
        if num_external <= 0:
            return
        c = self.shape.chunk_tokens
        end = start + num_external
        first, last = start // c, -(-end // c)
        self._loads.append(LoadSpec(
            rid, [[keys.variant_key(k, found.encoding) for k in chain[first:last]]
                  for chain in found.chains], first, start, end, list(block_ids)))
        tracked.next_save = max(tracked.next_save, last)

    # -- per step -------------------------------------------------------------------------------

    def build(self, so: SchedulerOutput) -> KDNConnectorMetadata:
        meta = KDNConnectorMetadata(loads=self._loads, preempted=set(so.preempted_req_ids or ()))
        self._loads = []
        if self._forget:
            meta.forget = [[k for ranks in self._forget for k in ranks[r]]
                           for r in range(len(self._forget[0]))]
            self._forget = []
        for rid in meta.preempted:  # first: a request resumed in this same step (vLLM's
            # reset_prefix_cache preempts between steps) takes its new block table below
            t = self._tracked.get(rid)
            if t is not None:
                t.block_ids = []
        done_by: dict[str, int] = {}
        for new in so.scheduled_new_reqs:
            t = self._tracked.get(new.req_id)
            if t is not None:
                t.block_ids = list(new.block_ids[0])
                done_by[new.req_id] = new.num_computed_tokens + so.num_scheduled_tokens.get(
                    new.req_id, 0)
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            t = self._tracked.get(rid)
            if t is None:
                continue
            added = cached.new_block_ids[i]
            if rid in cached.resumed_req_ids:
                t.block_ids = list(added[0]) if added is not None else []
            elif added is not None:
                t.block_ids.extend(added[0])
                if t.exact:  # new blocks, written afresh
                    self._lossy.difference_update(added[0])
                else:
                    self._lossy.update(added[0])
            done_by[rid] = cached.num_computed_tokens[i] + so.num_scheduled_tokens.get(rid, 0)
        if self.save:
            meta.saves = self._saves(done_by)
        return meta

    def _saves(self, done_by: dict[str, int]) -> list[SaveSpec]:
        c, b = self.shape.chunk_tokens, self.shape.block_size
        out = []
        for rid, done in done_by.items():
            t = self._tracked[rid]
            last = min(done, t.prompt_len) // c
            last = min(last, len(t.chains[0]), len(t.block_ids) * b // c)
            if last <= t.next_save:
                continue
            first = t.next_save
            attended = t.block_ids[: last * c // b]
            out.append(SaveSpec(rid, [chain[first:last] for chain in t.chains], first,
                                t.block_ids[first * c // b : last * c // b], t.mend,
                                exact=t.exact and self._lossy.isdisjoint(attended),
                                attended=attended))
            t.next_save = last
        return out

    def output(self, connector_output: KVConnectorOutput) -> None:
        """Blocks that failed to load are recomputed by vLLM; the chunks they belong to, and
        those after them, are saved again once recomputed (a damaged chunk, or one written
        under its key with another shape, is mended for the next request)."""
        bad = connector_output.invalid_block_ids
        if not bad:
            return
        log.info("kdn: %d blocks failed to load and are recomputed", len(bad))
        c, b = self.shape.chunk_tokens, self.shape.block_size
        for t in self._tracked.values():
            first = next((i for i, blk in enumerate(t.block_ids) if blk in bad), None)
            if first is not None:
                t.suspect_end = max(t.suspect_end, t.next_save)
                t.next_save, t.mend = min(t.next_save, first * b // c), True

    def finished(self, req_id: str) -> None:
        with self._lock:
            look = self._lookups.pop(req_id, None)
        if look is not None:
            look.future.cancel()
        t = self._tracked.pop(req_id, None)
        if t is not None and t.next_save < t.suspect_end:  # ended before its chunks were
            # stored again: another rank may have stored them computed over the failed load
            self._forget.append([chain[t.next_save : t.suspect_end] for chain in t.chains])

    def reset(self) -> None:
        """vLLM's ``reset_cache`` (module docstring): what kdn holds is not read again."""
        with self._lock:
            self._epoch = os.urandom(16)
            rids = set(self._lookups) | set(self._tracked)
        for rid in rids:
            self.finished(rid)
        log.info("kdn: cache reset (vLLM reset_cache): chunks stored before are no longer "
                 "looked up; this engine's new keys are its own until it restarts")

    def pending(self) -> int:
        """Lookups not yet consumed (for tests and metrics)."""
        with self._lock:
            return len(self._lookups)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._own_client:
            self.client.close()

