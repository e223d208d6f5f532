"""KDNEngine: a transformers model that reuses cached prefixes from kdn and prefills only what
is missing. It implements the connector protocol (``kdn.engine.connector.KVConnector``) and
drives itself through it, as an engine wrapping kdn would.

Lifecycle of ``KDNEngine.generate(prompt)``:

1. tokenize; chain keys over the prompt's full ``chunk_tokens`` blocks (``keys.prefix_keys``),
   keeping at least one token to compute so the model yields next-token logits;
2. ``start_load``: one batched Lookup for every block and every stored encoding (the leading
   run of present blocks is the reusable prefix, what ``matched_tokens`` reports); the loading
   controller picks an encoding or recompute (measured bandwidth of the path the hit would take,
   decode speed, prefill speed; overridable per request); every block's Retrieve stream starts
   at once, each asked to be a block of this engine's (its layout, ``chunk_tokens`` tokens:
   an entry of another shape under a block's key is refused before it is decoded);
3. the model's forward over the rest of the prompt runs on a ``kdn.model.hf.LayerwiseCache`` that
   calls ``wait_for_layer(i)`` right before decoder layer i, so layer i computes while later
   layers still arrive -> first token (TTFT ends here). Every cache the engine runs keeps
   every token's KV in every layer (``kdn.model.hf.full_cache``): a sliding-window model's own
   keeps only its window, which the model's mask confines each layer to either way;
4. ``save_layer(i, ...)`` for every layer: the newly computed blocks are stored back on a
   background thread (``kdn.engine.store_back``; ``wait_for_save`` joins it), then
   ``kdn.model.hf.greedy`` decodes the rest. ``close()`` (or leaving ``with KDNEngine(...)``)
   waits for every store still running; at exit a hook waits for them a bounded time.

A load that fails (a block refused, damaged, cut off; the server unreachable) never fails the
request: the prompt is computed whole (``Timings.load_error`` says why) and its blocks in the
encoding that failed are stored again, so a damaged block is mended for the next request; the
request counts as the recompute it became (``Timings.decision``, the controller's ``counts``). A
server that can not be reached or does not answer the lookup within
``EngineConfig.lookup_timeout_s`` (2 s, not the client's whole call deadline) costs a request
that much: its prompt is computed whole and nothing is stored back (a WARNING for the first such
request, then one a minute, an INFO line once it answers: ``kdn.ratelog``). A load has a
deadline of its own (``LOAD_DEADLINE_X`` times its predicted TTFT, at least
``lookup_timeout_s``): a server that stalls after the lookup costs a request that, after which
the load is cancelled, the prompt computed whole (``Timings.load_error``: DeadlineExceeded) and
the encoding left out for a while, as a failed load's (``LoadingController.observe_failure``),
but its blocks, only late, are not stored again (nor where a caller's own ``wait_for_layer``
timeout runs out). A block gone between the lookup and the load (evicted, deleted) leaves the
blocks before it reused and the rest computed, and stored again.

What it stores: ``EngineConfig.encodings``, or by default what pays off on the model's device
and the path its hits take (``kdn.delivery.default_encodings``: ``lossless`` on a CPU, ``raw``
on a GPU whose server shares its host, ``kdn-default`` and ``raw`` across a network).

Before its first decision the engine times one calibration prefill of
``EngineConfig.calibration_tokens`` tokens (``calibrate``), so the controller knows the model's
prefill speed on this machine instead of a prior; it times the decode of one random block in
each stored encoding the controller has no speed for on this device, and, when hits come
across a network, measures that link (``kdn.client.probe``). After each request what its load
or prefill took teaches the controller (``kdn.engine.measure`` holds these measurements). Every
request records the TTFT the controller predicted when it decided and the one measured
(``Timings.predicted_ttft_s``, ``ttft_s``): the controller keeps their running error
(``ttft_error``) and, once ``kdn.client.metrics`` is enabled, both are exported
(``kdn_client_ttft_seconds``).

Each stored block holds only its own ``chunk_tokens`` tokens (start position i * chunk_tokens)
under its chained key, so storage stays linear in prompt length.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import hashlib
import logging
import math
import threading
import time
from collections.abc import Sequence
from typing import Any

import torch

from kdn import checks, keys
from kdn.cache import LayerKV
from kdn.checks import whole
from kdn.client import Client, LayerStream
from kdn.client import metrics as client_metrics
from kdn.client.deadline import deadline_within
from kdn.client.probe import probe_link
from kdn.delivery import (
    IN_PROCESS,
    NETWORK,
    RECOMPUTE,
    SAME_HOST,
    LoadingController,
    default_encodings,
    encoding_name,
)
from kdn.engine.config import (
    EngineConfig,
    Generation,
    Timings,
    check_fits,
    check_force,
    check_layer,
    check_saved_layer,
    check_streams,
    default_chunk_tokens,
    prompt_ids,
)
from kdn.engine.connector import KVConnector
from kdn.engine.measure import GROW_S, observe_request, time_decodes, time_prefill
from kdn.engine.store_back import StoreBack
from kdn.errors import (
    DeadlineExceeded,
    InvalidRequest,
    TooLarge,
    again,
    kept,
)
from kdn.layout import KVLayout
from kdn.model.hf import (
    CacheDecoder,
    LayerwiseCache,
    cache_layers,
    check_cache,
    full_cache,
    greedy,
    length_regime,
    model_device,
    model_layout,
    prompt_limits,
    stop_tokens,
)
from kdn.ratelog import Outage

log = logging.getLogger(__name__)

_PING = hashlib.blake2b(b"kdn/engine/ping", digest_size=32).digest()
"""The key looked up to learn whether the server answers (``KDNEngine._answers``)."""
LOAD_DEADLINE_X = 4.0
"""A load not in within this many times its predicted TTFT (and ``lookup_timeout_s``) is
abandoned and the prompt computed: a server that stalls after the lookup costs a request
about that, not the client's whole call deadline."""
MIN_LOAD_DEADLINE_S = 0.25
"""The shortest deadline a load gets, whatever its prediction."""
PROBE_BUDGET_X = 5.0
"""A calibration's link probe (``kdn.client.probe``) takes at most this many times
``lookup_timeout_s``: a link too slow for its entries is reported slow, not waited for."""


class KDNEngine(KVConnector):
    """Greedy generation with prefix reuse (module docstring); one request at a time."""

    def __init__(self, model: Any, tokenizer: Any, client: Client,
                 config: EngineConfig | None = None,
                 controller: LoadingController | None = None) -> None:
        self.model = model
        self._vocabulary, self._context = prompt_limits(model)  # InvalidArgument: unsupported
        self.tokenizer = tokenizer
        self.client = client
        self._outage = Outage(log, f"kdn: the server {client.address} answers again")
        self.config = config or EngineConfig()
        if not self.config.namespace:  # the client's
            self.config = dataclasses.replace(self.config, namespace=getattr(
                client, "namespace", None) or keys.DEFAULT_NAMESPACE)
        self.controller = controller or LoadingController()
        self._device = model_device(model)
        self.controller.device = self._device.type  # decode speeds are learnt per device
        self._layout = model_layout(model, self.config.kv_dtype, self.config.weights_id,
                                    exact=True)  # KV another dtype computed is not a raw hit
        check_cache(model, self._layout, "KDNEngine")  # InvalidArgument: MLA, SSM layers, ...
        # a hit's layers pipeline where the device decodes while the host receives; on a CPU
        # the receive, the decode and the model share the cores, and bench.link measured
        # transfer and decode adding up there
        self.controller.layers = self._layout.num_layers if self._device.type == "cuda" else 1
        self._calibrated = not self.config.calibrate
        self._settled = False  # the heap frozen (EngineConfig.freeze_heap) before request 1
        if not self.config.chunk_tokens:
            self.config = dataclasses.replace(self.config,
                                              chunk_tokens=default_chunk_tokens(self._layout))
        if self.config.encodings is None:
            path = (IN_PROCESS if client.local is not None
                    else self._link()[0] if self._answers() else NETWORK)
            self.config = dataclasses.replace(
                self.config, encodings=default_encodings(self._device.type, path))
        self._saver = StoreBack(client, self._layout, self.config.chunk_tokens, self.encodings,
                                self.namespace, self._device, self._lookup_timeout())
        self._request = threading.Lock()
        self._begin([])

    @property
    def layout(self) -> KVLayout:
        return self._layout

    @property
    def namespace(self) -> str:
        """The namespace its blocks live in: its config's, or else the client's."""
        assert self.config.namespace  # resolved in __init__
        return self.config.namespace

    @property
    def encodings(self) -> tuple[tuple[str, str], ...]:
        """The (mode, level) pairs this engine stores and looks up: its config's, or the
        device's defaults it resolved to."""
        assert self.config.encodings is not None  # resolved in __init__
        return self.config.encodings

    @property
    def ttft_error(self) -> float:
        """Mean ``|predicted / measured - 1|`` of the requests' TTFT so far (the
        controller's ``ttft_error``)."""
        return self.controller.ttft_error

    @torch.no_grad()
    def calibrate(self) -> float:
        """Time prefills of ``config.calibration_tokens`` tokens (a GPU: longer ones too) and
        one token after, for the controller (``measure.time_prefill``); returns the first's
        seconds. Then time the decode of each stored encoding the controller has no speed for
        here (``time_decodes``) and, across a network, measure the link."""
        got, step = time_prefill(self.model, self.config.calibration_tokens, self._device,
                                 GROW_S if self._device.type == "cuda" else 0.0)
        for n, seconds in got:  # the shortest first: prefill_tok_s ends at the longest's
            self.controller.calibrate_prefill(n, seconds)
            log.info("calibration: %d tokens prefilled in %.4f s", n, seconds)
        self.controller.calibrate_step(step)
        self._calibrated = True
        time_decodes(self.controller, self.encodings, self.layout, self.config.chunk_tokens,
                     self._device)
        if self.config.probe_link and self._answers():
            path, server = self._link()
            if path == NETWORK:
                probe = probe_link(self.client, self.namespace,
                                   budget_s=PROBE_BUDGET_X * self.config.lookup_timeout_s)
                if probe is not None:
                    self.controller.calibrate_link(probe.bytes_per_s, path, server)
        return got[0][1]

    def _ensure_calibrated(self) -> None:
        if not self._calibrated:
            self.calibrate()
        if not self._settled:
            self._settled = True
            if self.config.freeze_heap or (self.config.freeze_heap is None
                                           and self._device.type == "cuda"):
                gc.collect()
                gc.freeze()

    def _check_force(self, force: str | None) -> None:
        check_force(force, [encoding_name(m, lv) for m, lv in self.encodings] + [RECOMPUTE])

    def _lookup_timeout(self) -> float:
        """``lookup_timeout_s``, at most the client's ``timeout_s`` (None: no deadline)."""
        limit = getattr(self.client, "timeout_s", None)
        return self.config.lookup_timeout_s if limit is None else min(
            self.config.lookup_timeout_s, limit)

    def _load_deadline(self, predicted_s: float) -> float:
        """Seconds the chosen load may take before it is abandoned: ``LOAD_DEADLINE_X`` times
        its predicted TTFT, at least ``lookup_timeout_s`` and ``MIN_LOAD_DEADLINE_S``."""
        return max(self._lookup_timeout(), LOAD_DEADLINE_X * predicted_s, MIN_LOAD_DEADLINE_S)

    def _answers(self) -> bool:
        """Whether the server answers a Lookup of no keys within ``lookup_timeout_s`` (before
        calls that would wait a whole call deadline on a server that does not answer)."""
        try:
            self.client.lookup([_PING], namespace=self.namespace,
                               timeout_s=self._lookup_timeout())
        except Exception as exc:  # a WARNING per outage, not per request (``Outage``)
            self._outage.failed("kdn: the server %s does not answer (%s); going on without it",
                                self.client.address, exc)
            return False
        self._outage.answered()
        return True

    def _link(self) -> tuple[str, str]:
        """(path kind, server address) a hit not in the process takes: the server's host
        when the data plane shares a segment with it, else the network."""
        try:
            same = self.client.dataplane.attached
        except Exception:  # the server can not be reached now: the lookup will say so
            same = False
        return (SAME_HOST if same else NETWORK), self.client.address

    def _begin(self, ids: list[int]) -> None:
        """Forget the previous request's state."""
        self._ids = ids
        self._timings = Timings()
        self._streams: list[LayerStream] = []
        self._streams_checked = False  # their layouts, tokens and positions (``check_streams``)
        self._loaded_blocks = 0
        self._load_failed: BaseException | None = None
        self._load_until = math.inf  # perf_counter by which every layer must be in
        self._load_s = 0.0  # the load's deadline, seconds
        self._rewrite = ""  # the one whose blocks are stored again (damaged, refused, missing)
        self._saved: dict[int, LayerKV] = {}
        self._save_refused = False  # a layer not of the prompt's length: nothing stored
        self._unreachable = False  # the lookup failed: nothing stored either
        self._store_thread: threading.Thread | None = None
        self._path, self._server = NETWORK, ""

    # -- the connector protocol -----------------------------------------------------------------

    def _chain(self, ids: Sequence[int]) -> list[bytes]:
        """Chain keys of the blocks that may be reused (one token is always left to compute);
        what their KV depends on beyond the ids (``length_regime``) enters them."""
        c = self.config.chunk_tokens
        usable = (len(ids) - 1) // c
        return keys.prefix_keys(list(ids[: usable * c]), self.layout, self.namespace, c,
                                extras=[length_regime(self.model, len(ids))])

    def _present(self, chain: list[bytes]
                 ) -> tuple[int, dict[str, int], frozenset[str], dict[str, list[bytes]]]:
        """(leading blocks present in the best encoding, stored bytes of those blocks by
        encoding name for each encoding holding all of them, the encodings whose blocks are
        all in the client's in-process tier, the keys looked up by encoding name): one
        batched Lookup."""
        names = [encoding_name(m, lv) for m, lv in self.encodings]
        asked = {n: [keys.variant_key(k, n) for k in chain] for n in names}
        infos = self.client.lookup([k for n in names for k in asked[n]],
                                   namespace=self.namespace,
                                   timeout_s=self._lookup_timeout()).infos
        self._outage.answered()
        rows = {name: infos[j * len(chain) : (j + 1) * len(chain)]
                for j, name in enumerate(names)}
        hits = {name: next((i for i, info in enumerate(row) if not info.present), len(row))
                for name, row in rows.items()}
        best = max(hits.values(), default=0)
        stored = {name: sum(info.size_bytes for info in rows[name][:best])
                  for name in names if best and hits[name] == best}
        local = frozenset(name for name in stored
                          if all(info.in_process for info in rows[name][:best]))
        return best, stored, local, asked

    def matched_tokens(self, token_ids: Sequence[int]) -> int:
        """Leading tokens stored; 0 where the server can not be reached or does not answer
        within ``lookup_timeout_s``. InvalidArgument for what ``start_load`` refuses (bools,
        a batch: ``checks.token_ids``)."""
        chain = self._chain(checks.token_ids(token_ids, "matched_tokens"))
        if not chain:
            return 0
        try:
            return self._present(chain)[0] * self.config.chunk_tokens
        except Exception as exc:  # nothing can be loaded from a server that does not answer
            self._outage.failed("kdn: lookup failed (%s); nothing matched", exc)
            return 0

    def _load_failure(self, exc: BaseException, encoding: str) -> None:
        """A load of ``encoding``'s blocks failed with ``exc``: the prompt is computed whole,
        so ``save_layer`` stores every block, not only those after the ones that were meant to
        load; the encoding is left out for a while (the controller learns it), also where it
        was only late (else a link that got too slow for it costs every request its deadline
        and a prefill); its blocks are stored again unless they were only late (the load's
        deadline, or a caller's ``wait_for_layer`` timeout, passed) or too large for the
        memory here (nothing wrong with them)."""
        late = isinstance(exc, (DeadlineExceeded, TimeoutError))
        self._rewrite = "" if late or isinstance(exc, TooLarge) else encoding
        self._loaded_blocks = 0
        self._timings.load_error = f"{type(exc).__name__}: {exc}"
        self._recomputed(encoding)
        self.controller.observe_failure(encoding, self._path, self._server)

    def _recomputed(self, choice: str) -> None:
        """The load the controller chose (``choice``) ends in the prompt computed whole: the
        request is counted, and timed, as the recompute it became."""
        self.controller.recomputed(choice)
        self._timings.decision = RECOMPUTE

    def start_load(self, token_ids: Sequence[int], *, force: str | None = None) -> int:
        """Begin loading the reusable prefix of a new request (what is left of the last one
        is let go: its loads cancelled, its state forgotten; ``save_layer`` then stores under
        these ids' keys); ``force`` (one of the engine's encoding names, or ``recompute``)
        overrides the loading controller for this request."""
        self._check_force(force)
        token_ids = checks.token_ids(token_ids, "start_load")
        self._ensure_calibrated()
        self.finish()
        self._begin(token_ids)
        t = self._timings
        c = self.config.chunk_tokens
        chain = self._chain(token_ids)
        t.decision = RECOMPUTE
        t.predicted_ttft_s = self.controller.prefill_seconds(len(token_ids))
        if not chain or force == RECOMPUTE:
            return 0
        t0 = time.perf_counter()
        try:
            hits, stored, local, asked = self._present(chain)
        except Exception as exc:  # not reached, or too slow: the prompt is computed whole
            t.lookup_s = time.perf_counter() - t0
            self._outage.failed("kdn: lookup failed (%s); computing the prompt", exc)
            t.load_error = f"{type(exc).__name__}: {exc}"
            self._unreachable = True  # nor is anything stored back
            return 0
        t.lookup_s = time.perf_counter() - t0
        tokens = hits * c
        self._path, self._server = self._link()
        decision = self.controller.choose(tokens, tokens * self.layout.bytes_per_token, stored,
                                          override=force, local=local, path=self._path,
                                          server=self._server)
        t.predicted_ttft_s = t.lookup_s + self.controller.prefill_seconds(len(token_ids))
        if decision.choice == RECOMPUTE or not hits:
            return 0
        blocks = (asked[decision.choice][:hits] if decision.choice in asked else  # looked up:
                  [keys.variant_key(k, decision.choice) for k in chain[:hits]])  # not hashed again
        self._load_s = self._load_deadline(decision.estimates_s[decision.choice]
                                           + self.controller.suffix_seconds(
                                               len(token_ids) - tokens))
        self._load_until = time.perf_counter() + self._load_s
        try:  # every block must be one of this engine's: its layout, chunk_tokens tokens
            joined = None
            if hits > 1 and decision.choice in local and self.config.join_in_process:
                joined = self.client.retrieve_joined(blocks, namespace=self.namespace,
                                                     layout=self.layout, tokens=c,
                                                     device=self._device)
            with deadline_within(self._load_s):  # its network calls end by the load's deadline
                streams = [joined] if joined is not None else self.client.retrieve_streams(
                    blocks, namespace=self.namespace, layout=self.layout, tokens=c,
                    device=self._device)  # layers land on the model's device
        except Exception as exc:  # unreachable, refused, not a block of ours: recompute
            log.warning("kdn: loading %d blocks failed (%s); computing the prompt", hits, exc)
            self._load_until = math.inf
            self._load_failure(exc, decision.choice)
            return 0
        present = [s for s in streams if s is not None]
        if sum(s.blocks for s in present) < hits:  # evicted between lookup and retrieve:
            lead = next((j for j, s in enumerate(streams) if s is None), 0)  # leading run kept
            for s in present[lead:]:
                s.cancel()
            log.warning("kdn: block %d of %d went missing between lookup and load; the %d "
                        "before it are reused", lead, hits, lead)
            if not lead:  # nothing to reuse: counted as what it becomes
                self._load_until = math.inf
                t.load_error = (f"NotFound: block 0 of {hits} went missing between the "
                                "lookup and the load")
                self._recomputed(decision.choice)
                return 0
            streams, hits, tokens = streams[:lead], lead, lead * c
        self._streams = [s for s in streams if s is not None]
        self._streams_checked = False
        t.decision = decision.choice
        t.predicted_ttft_s = (t.lookup_s + decision.estimates_s[decision.choice]
                              + self.controller.suffix_seconds(len(token_ids) - tokens))
        self._loaded_blocks = hits
        return tokens

    def wait_for_layer(self, i: int, timeout: float | None = None) -> LayerKV:
        """Layer i of the loaded prefix; waits at most ``timeout`` seconds (TimeoutError after
        them), or, where that is None, until the load's deadline (``_load_deadline``):
        DeadlineExceeded after it. InvalidRequest where no load is under way, or for a layer
        the model does not have. Once a layer failed or was late the load is over (its
        streams cancelled, the caller computes the prompt whole, ``save_layer`` stores every
        block, but a late load's blocks only where missing: ``_load_failure``), and every
        later call raises that failure again."""
        check_layer(i, self.layout.num_layers, "wait_for_layer")
        if self._load_failed is not None:
            raise again(self._load_failed)
        if not self._streams:
            raise InvalidRequest("wait_for_layer: no load is under way (start_load loaded "
                                 "nothing, or the request is over)")
        on = torch.cuda.current_stream(self._device) if self._device.type == "cuda" else None
        bounded = timeout is None and self._load_until < math.inf
        try:
            parts = [s.wait_for_layer(i, max(0.0, self._load_until - time.perf_counter())
                                      if bounded else timeout, stream=on)
                     for s in self._streams]
            if not self._streams_checked:  # (each stream's header is in once a layer is)
                check_streams(self._streams, self.layout, self.config.chunk_tokens)
                self._streams_checked = True
            # k: [kv_heads, tokens, k_channels], blocks joined along tokens
            out = parts[0] if len(parts) == 1 else (torch.cat([p[0] for p in parts], dim=1),
                                                    torch.cat([p[1] for p in parts], dim=1))
        except Exception as exc:  # remembered: ``generate`` then computes the prompt whole
            if bounded and isinstance(exc, TimeoutError):
                exc = DeadlineExceeded(
                    f"layer {i} of the {self._loaded_blocks} blocks loaded was not in within "
                    f"the load's deadline of {self._load_s:.3g} s (max of lookup_timeout_s, "
                    f"{LOAD_DEADLINE_X:g} x its predicted TTFT, {MIN_LOAD_DEADLINE_S:g} s)")
            # kept without its traceback (this frame, holding the engine, and the model's
            # forward, holding its tensors); a copy is raised, whose traceback is its own
            self._load_failed = kept(exc)
            self.finish()
            self._load_until = math.inf
            self._load_failure(exc, self._timings.decision)
            raise again(exc) from None
        return out

    def save_layer(self, i: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Layer i of the prompt's KV, [kv_heads, tokens, channels] (InvalidRequest if not, or
        for a layer the model lacks); once every layer is in, the blocks kdn lacks are stored
        on a background thread. A layer short of the prompt's tokens (a sliding window's cache
        keeps only its last ones) is refused: nothing of the request is stored (wrong KV)."""
        check_saved_layer(i, k, v, self.layout, "save_layer")
        c = self.config.chunk_tokens
        if (not self.config.store_back or self._save_refused or self._unreachable
                or len(self._ids) // c <= self._loaded_blocks):
            return
        if k.shape[-2] != len(self._ids) or v.shape[-2] != len(self._ids):
            log.warning("kdn: layer %d holds %d tokens' KV, the prompt %d (a sliding-window "
                        "cache?); nothing of this request is stored", i, k.shape[-2],
                        len(self._ids))
            self._save_refused = True
            self._saved.clear()
            return
        first, last = self._loaded_blocks * c, (len(self._ids) // c) * c
        self._saved[i] = self._saver.to_host(k, v, first, last)  # the blocks kdn lacks
        if len(self._saved) == self.layout.num_layers:
            snapshot = [self._saved[j] for j in range(self.layout.num_layers)]
            self._saved = {}  # the store thread holds them now, and lets go when it ends
            self._store_thread = self._saver.start(
                self._ids, snapshot, self._loaded_blocks, self._rewrite, self._timings.decision,
                extras=[length_regime(self.model, len(self._ids))])

    def wait_for_save(self, timeout: float | None = None) -> None:
        if self._store_thread is not None:
            self._store_thread.join(timeout)

    def close(self, timeout: float | None = 60.0) -> bool:
        """Wait for every store back still running, at most ``timeout`` seconds in all (None:
        no bound); True when none is left. Without it a process that exits right after
        ``generate`` keeps its last blocks only as long as the exit hook waits
        (``kdn.engine.store_back.EXIT_WAIT_S``). The client stays open (it is the caller's),
        and the engine usable."""
        return self._saver.join(timeout)

    def __enter__(self) -> KDNEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def finish(self) -> None:
        for s in self._streams:
            s.cancel()
        self._streams = []

    # -- generate -------------------------------------------------------------------------------

    @torch.no_grad()
    def generate(self, prompt: str | Sequence[int] | torch.Tensor, max_new_tokens: int = 32, *,
                 force: str | None = None) -> Generation:
        """Greedy generation reusing cached prefix blocks. ``prompt``: a text, token ids, or
        a tensor of them (``[tokens]`` or ``[1, tokens]``; one prompt, each id in the model's
        vocabulary: ``kdn.engine.config.prompt_ids``). ``max_new_tokens``: at least 1, as in
        transformers' ``generate``; decoding stops there or after an end token, as there
        (``kdn.model.hf.stop_tokens``: the model's generation_config and tokenizer's EOS). The
        prompt and ``max_new_tokens`` together fit the model's context
        (``kdn.engine.config.check_fits``). ``force``: one of the engine's encoding names or
        ``recompute``, to override the controller for this request. Each of these is checked
        before anything is looked up, computed or stored: InvalidRequest (an InvalidArgument
        and a ValueError) naming what is wrong."""
        whole("max_new_tokens", max_new_tokens, 1, " (as in transformers' generate)",
              InvalidRequest)
        self._check_force(force)
        ids = prompt_ids(prompt, self.tokenizer, self._vocabulary)
        check_fits(len(ids), max_new_tokens, self._context)
        with self._request:
            self._ensure_calibrated()  # before the clock starts: not this request's time
            start = time.perf_counter()
            reused = self.start_load(ids, force=force)
            t = self._timings  # (this request's: start_load began it)
            streams = list(self._streams)
            tc = time.perf_counter()
            try:
                decoder, logits = self._first_token(ids, reused)
            except Exception:
                failed = self._load_failed
                if failed is None:  # the model's own error, not the load's
                    raise
                log.warning("kdn: a block failed while loading (%s); computing the prompt",
                            failed)  # (wait_for_layer recorded it: _load_failure)
                streams, reused, t.decision = [], 0, RECOMPUTE
                decoder, logits = self._first_token(ids, 0)
            t.first_token_compute_s = time.perf_counter() - tc  # copies and compute are done
            t.ttft_s = time.perf_counter() - start
            t.reused_tokens, t.computed_tokens = reused, len(ids) - reused
            client_metrics.record_ttft(t.decision, t.predicted_ttft_s, t.ttft_s)  # every one
            if not t.load_error:  # a failed load's time teaches the controller nothing
                self.controller.observe_ttft(t.predicted_ttft_s, t.ttft_s)
                observe_request(self.controller, streams, t.decision, reused, t,
                                self._path, self._server, self.layout.bytes_per_token)
            for i, (k, v) in enumerate(cache_layers(decoder.cache)):
                self.save_layer(i, k[0], v[0])  # [1, kv_heads, tokens, ch] -> batch row 0
            store_thread = self._store_thread
            try:
                new = greedy(decoder, logits, max_new_tokens,
                             stop_tokens(self.model, self.tokenizer))
            finally:
                self._streams, self._saved = [], {}  # no KV of this prompt outlives it
                self._load_until = math.inf
        text = self.tokenizer.decode(new, skip_special_tokens=True)
        return Generation(text, new, t, store_thread)

    def _first_token(self, ids: list[int], reused: int) -> tuple[CacheDecoder, torch.Tensor]:
        """The decoder after the prompt (its first ``reused`` tokens' KV loaded layer by layer
        as the forward reaches them) and the next-token logits, on the host: on a GPU the
        queued copies and compute are done."""
        with contextlib.ExitStack() as hooks:
            cache = full_cache(self.model)  # every token's KV, also a sliding window's
            if reused:
                tb = time.perf_counter()
                cache = hooks.enter_context(LayerwiseCache(self.model, self.wait_for_layer))
                self._timings.cache_build_s = time.perf_counter() - tb
            decoder = CacheDecoder(self.model, cache)
            logits = decoder.forward(ids[reused:])[-1]
            int(logits.argmax())
        return decoder, logits
