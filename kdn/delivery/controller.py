"""The loading controller (CacheGen's idea): per request, fetch which encoding, or recompute?

Inputs, all measured: bandwidth per path (bytes/s of recent retrieves, kept per path kind:
``in-process``, ``same-host``, ``network``, and per server address), decode speed per encoding
and device (fp16-equivalent bytes/s), the model's prefill speed (tokens/s), and the stored
size of each encoding of the requested context (from one batched Lookup). The cheapest of
recompute and every available encoding wins. Every decision is logged and counted; a request
may force a choice (``override``).

Time to usable KV of an encoding, layer-pipelined: the stream decodes layer i while later
layers are still in flight, so with ``transfer = size / bandwidth`` and
``decode = kv_bytes / decode_speed`` spread evenly over ``layers`` layers, the slower stage
sets the pace and the faster one shows only for one layer (the first layer's transfer before
decode can start, or the last layer's decode after the last byte arrived)::

    max(transfer, decode) + min(transfer, decode) / layers

which lies between ``max`` (perfect overlap) and the sum (none; ``layers=1``: what the engine
sets on a CPU, where receiving, decoding and the model's layers share the same cores). A hit
is read back through the same formula (``observe_hit``): its decode time is the one that
reproduces its measured time with its measured transfer. Recomputing
costs ``tokens`` times the seconds per token of prompts of that length: a short prompt pays
mostly fixed per-forward costs (8 tokens at a twentieth of the rate of 256 on a CPU), a long
one attention's quadratic term. So prefills are kept per length class (the power of two at
or below the length, ``length_class``: the last ``RECENT`` samples, the fastest of fewer,
their median of three) and a prompt is predicted from the nearest class with samples: chat
turns of 8 tokens do not set the speed of a 288-token recompute. The engine calibrates one
class with the best of three timed prefills of a typical request length
(``calibrate_prefill``) before its first decision; a real prefill faster than that
calibration (one that met a busy spell) replaces it at once, being the faster of two.
The tokens a hit leaves to compute (often one) run after the whole loaded context: their
forward costs at least one token's after the calibration prefill (``calibrate_step``: the
weights read once, attention over the context), which a prefill's seconds per token leave
out (``suffix_seconds``; on a CPU ~60 ms of a 0.12 s hit of 2048 tokens). Hits are learnt
without it, so it does not pass for decode time that other encodings would then carry.

Speeds start from priors (or the calibration) and follow observations as exponentially
weighted means, so the controller adapts when a link or the machine changes. Each request's
predicted and measured TTFT are fed back (``observe_ttft``): their running error
(``ttft_error``) says how far to trust the estimates.

What a hit costs beyond its codec. A decode calibration times the codec alone on one block;
a hit also assembles every layer of every block and feeds it to the model, work that is the
same per byte of KV whichever encoding carried it. Each hit of a calibrated encoding shows that
work (its cost beyond the transfer less its calibrated codec time): the controller keeps it
per device (``overhead_s_b``) and adds it to every encoding known only from a calibration,
so one hit does not leave the encodings not yet tried looking cheaper than they are.

One path, several encodings. One bandwidth per path serves every encoding, yet on a busy
host the bytes of an encoding whose decode competes with the receive for the cores cross the
same link slower than raw bytes do. So each encoding's transfers also keep, per route, their
rate over the route's bandwidth (``transfer_fits``, a running mean, 1 until seen), and the
route learns each rate divided by its encoding's share: an encoding's transfer is estimated
at its share of the route's bandwidth, which follows the link whichever encoding shows a
change, and not the mix of encodings that crossed it. Shares are relative: the fastest
encoding seen on a route has 1, and the route's bandwidth is the rate it crosses at (an
encoding not yet seen there, or a new server of its kind, is estimated at that). An
encoding's own samples (its decode time from a hit, its share of a route) reach their
running means as the median of their last ``RECENT``: a straggler (another job took the
cores for one request) would otherwise stay in the estimate of the encoding it hit until
that encoding is chosen again.
Before there are ``RECENT`` of a hit's decode samples, one moves the estimate it had (a
calibration, a prior) at most twofold, to their geometric mean, and two give the faster:
a fresh engine's first hit that meets a stall does not make loading look ten times slower.

Decisions with hysteresis. Each option's measured cost (seconds per KV byte of a hit per
encoding and route, ``route_key``; seconds per token of a recompute) is kept as a running
mean and a running mean deviation (``spread``): how much one observation of it scatters. On
a route where it chose before, the controller leaves its last choice (``last_choice``) only
for an option whose estimate is lower by more than the two estimates' combined relative
error, within [``margin_min``, ``margin_max``] (an option seen fewer than twice counts
``margin_max``). One slow request (a busy host, a cold cache) therefore does not flip the
choice, while a link that really got slower does, within a few requests.

Trying what is close. Before an encoding is seen on a route its estimate rests on the link
probe and a calibration, both taken once and easily 25% off on a busy host. So once the
choice has been seen there, every stored encoding whose estimate lies within ``explore`` of it
and that was seen fewer than ``trials`` times on that route is tried, the closest first
(``Decision`` says so); the route's last choice stays what it was, and later requests weigh
both as seen. One trial each: a trial costs up to ``explore`` of a request, and a second one
(against a straggler in the first) cost more than it saved where two encodings lie 10-25%
apart, as ``raw`` and ``int8`` do from 10 Gbit/s up on a CPU (``bench.link``); an estimate a
straggler left wrong is still corrected by the re-trials.

Re-trials. An estimate is corrected only by observing its option, so an option never chosen
(recompute after a calibration that met a busy spell, an encoding after a straggler) could
stay wrong for good. An option not chosen on a route for ``retry_every`` decisions whose
estimate is within ``retry_cost`` of the choice's is chosen once instead (at most one such
re-trial per ``retry_every`` decisions on a route), the longest unseen first; each re-trial
of an option doubles its gap, up to ``retry_max``, and being chosen resets it. A re-trial of
recompute where blocks are stored computes the prompt and is observed as a prefill.

Failures. A load that fails (``observe_failure``: a timeout, a block refused) leaves its
encoding out of that route's decisions for ``retry_every / 4`` decisions, twice as many after
each further failure, until a hit of it is seen there: a failing load is not paid for on
every request.
"""

from __future__ import annotations

import logging
import math
import statistics
import threading
from collections import Counter
from dataclasses import dataclass, field

from kdn.delivery.defaults import (
    DECODE_PRIORS_B_S,
    IN_PROCESS,
    NETWORK,
    PATH_PRIORS_B_S,
    RECOMPUTE,
    SAME_HOST,
    option_key,
    path_priors,
    route_key,
)
from kdn.delivery.measures import (
    RECENT,
    Prefills,
    Spread,
    check_settings,
    measured,
    rate_of,
    relative,
    speed,
)

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Decision:
    choice: str
    """An encoding name (``encoding_name(mode, level)``, e.g. ``lossless``, ``kdn-default``) or
    ``recompute``."""
    estimates_s: dict[str, float]
    reason: str


@dataclass
class LoadingController:
    bandwidth_b_s: float | None = None
    """One prior for every link (same-host and network paths; the in-process tier has no
    link) until retrieves over it are observed; None (default): ``PATH_PRIORS_B_S``."""
    priors_b_s: dict[str, float] = field(default_factory=lambda: dict(PATH_PRIORS_B_S))
    """Bandwidth prior (bytes/s) per path kind (``PATHS``); a kind not named keeps
    ``PATH_PRIORS_B_S``'s. The controller keeps a copy (the caller's dict is left as it was)."""
    bandwidths_b_s: dict[str, float] = field(default_factory=dict)
    """Learnt bandwidth (bytes/s) per path kind (``"same-host"``) and per path kind and
    server (``"network@host:port"``): a new server starts from what its kind showed."""
    prefill_tok_s: float = 500.0
    """Prior prefill speed (tokens/s) until prefills are observed."""
    decode_b_s: dict[str, float] = field(default_factory=dict)
    """Decode speed (fp16-equivalent bytes/s) per ``"<encoding>@<device>"`` seen in hits: a
    GPU decodes the compressed modes far faster than a CPU, so what wins on one host loses on
    another; until a hit is seen, the calibration (``codec_b_s``, plus ``overhead_s_b``),
    else ``DECODE_PRIORS_B_S``, else 1 GB/s."""
    codec_b_s: dict[str, float] = field(default_factory=dict)
    """Calibrated codec speed (bytes/s of KV) per ``"<encoding>@<device>"``: one block
    decoded alone (``calibrate_decode``)."""
    overhead_s_b: dict[str, float] = field(default_factory=dict)
    """Per device: seconds per KV byte a hit costs beyond its codec (module docstring),
    learnt from hits of calibrated encodings."""
    device: str = "cpu"
    """Where the engine decodes (its model's device type): the key's default device. Each
    ``KDNEngine`` sets it and ``layers`` to its model's, so engines sharing one controller
    (threads may) must run on one kind of device and layer count."""
    layers: int = 1
    """Layers over which a hit's transfer and decode overlap (the engine sets its model's on
    a GPU); 1 adds them up."""
    alpha: float = 0.3
    """Weight of a new observation in the running means, in [0, 1]."""
    margin_min: float = 0.02
    """Least relative gain for which the controller leaves its last choice on a route."""
    margin_max: float = 0.10
    """Most relative gain it asks for, however much the estimates scatter: above it, a
    better option is taken whatever the noise."""
    explore: float = 0.25
    """An encoding seen fewer than ``trials`` times on a route whose estimate lies within this
    fraction of the choice's is tried, after the choice itself was seen there (module
    docstring)."""
    trials: int = 1
    """Hits of a close encoding on a route before the controller stops trying it (module
    docstring: why one)."""
    retry_every: int = 16
    """Re-trials (module docstring): at most one per this many decisions on a route, and an
    option not chosen there for this many decisions is due; 0 turns re-trials off."""
    retry_max: int = 256
    """The longest gap between two re-trials of one option: each re-trial doubles its gap,
    from ``retry_every`` up to this; being chosen resets it."""
    retry_cost: float = 3.0
    """Only an option whose estimate is at most this multiple of the choice's is re-tried."""
    counts: Counter[str] = field(default_factory=Counter)
    spread: dict[str, Spread] = field(default_factory=dict)
    """Measured cost per option (module docstring): ``"<encoding>@<route>"`` (seconds per KV
    byte of a hit) and ``recompute`` (seconds per token)."""
    transfer_fits: dict[str, float] = field(default_factory=dict)
    """Per ``"<encoding>@<route>"``: the rate its hits' bytes crossed the route at, over the
    route's bandwidth then (a running mean; module docstring)."""
    last_choice: dict[str, str] = field(default_factory=dict)
    """The last choice made (not overridden) per route (``route_key``)."""
    calibrated_tokens: int = 0
    """Length of the calibration prefill that set ``prefill_tok_s`` (0: not calibrated)."""
    ttft_requests: int = 0
    """Requests whose predicted and measured TTFT were observed."""
    ttft_abs_ratio_sum: float = 0.0
    """Sum over them of ``|predicted / measured - 1|``."""
    last_ttft: tuple[float, float] = (0.0, 0.0)
    """(predicted, measured) TTFT of the last observed request, seconds."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    _recent: dict[str, list[float]] = field(default_factory=dict, repr=False)
    """The last ``RECENT`` samples per key, for ``_filtered``."""
    prefills: Prefills = field(default_factory=Prefills, repr=False)
    """The prefills seen, per length class, and one token's forward after a prefill
    (``kdn.delivery.measures.Prefills``)."""
    decisions: Counter[str] = field(default_factory=Counter)
    """Decisions made per route (not overridden, something stored): the re-trials' clock."""
    _tried: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    """Per (route, option): the decision at which it was last chosen, kept or tried."""
    _gap: dict[tuple[str, str], int] = field(default_factory=dict, repr=False)
    """Per (route, option): decisions before its next re-trial is due."""
    _retried: dict[str, int] = field(default_factory=dict, repr=False)
    """Per route: the decision of its last re-trial."""
    _suspended: dict[tuple[str, str], tuple[int, int]] = field(default_factory=dict, repr=False)
    """Per (route, encoding) whose load failed: (the decision until which it is left out,
    the decisions the next failure leaves it out for)."""

    def __post_init__(self) -> None:
        self.priors_b_s = path_priors(self.priors_b_s)
        check_settings(self)
        if self.bandwidth_b_s is not None:
            self.priors_b_s[SAME_HOST] = self.priors_b_s[NETWORK] = self.bandwidth_b_s

    def _ewma(self, old: float, new: float) -> float:
        return (1 - self.alpha) * old + self.alpha * new

    def _filtered(self, key: str, x: float) -> float:
        """The median of ``key``'s last ``RECENT`` samples with ``x``: what the running means
        of an encoding's own hits take, so that one straggler among them moves nothing."""
        got = self._recent.setdefault(key, [])
        got.append(x)
        del got[:-RECENT]
        return statistics.median(got)

    def observe_transfer(self, nbytes: int, seconds: float, path: str = NETWORK,
                         server: str = "", encoding: str = "") -> None:
        """``nbytes`` crossed ``path`` (from ``server``, where known) in ``seconds``: both
        the path kind's estimate and the server's follow it; with the ``encoding`` they
        carried, its share of that path (``transfer_fits``) too, kept relative to the route's
        fastest encoding (``_relative_shares``). A rate, bandwidth or share that is no
        ``speed`` (a time of 5e-324 s) is ignored, as other bad observations are."""
        rate = rate_of(nbytes, seconds)
        if rate is None:
            return
        route = route_key(path == IN_PROCESS, path, server)
        fit = f"{encoding}@{route}"
        own = f"{path}@{server}" if server else path
        with self._lock:
            # the route learns the rate divided by the encoding's share: the encodings' mix
            # does not move it, a change of the link does
            olds = {path: self.bandwidth(path)}
            if server:
                olds[own] = self.bandwidth(path, server)
            link = rate / self.transfer_fits.get(fit, 1.0) if encoding else rate
            new = {key: self._ewma(old, link) for key, old in olds.items()}
            share = rate / new[own]
            if not all(speed(v) for v in (link, share, *new.values())):
                return
            self.bandwidths_b_s.update(new)
            if encoding:
                share = self._filtered("share:" + fit, share)
                self.transfer_fits[fit] = self._ewma(self.transfer_fits.get(fit, share), share)
                self._relative_shares(route, own)

    def _relative_shares(self, route: str, own: str) -> None:
        """Scale ``route``'s shares so that its fastest encoding's is 1, and its bandwidth
        (``own``) by as much (module docstring): each encoding's estimate stays, the bandwidth
        follows a changed link. With the lock held."""
        fits = [k for k in self.transfer_fits if k.split("@", 1)[1] == route]
        top = max(self.transfer_fits[k] for k in fits)
        scaled = self.bandwidths_b_s[own] * top
        if top == 1.0 or not speed(scaled):
            return
        self.bandwidths_b_s[own] = scaled
        for k in fits:
            self.transfer_fits[k] /= top
            self._recent["share:" + k] = [x / top for x in self._recent.get("share:" + k, [])]

    def bandwidth(self, path: str = NETWORK, server: str = "") -> float:
        """Bandwidth (bytes/s) of ``path`` from ``server``: learnt for that server, else for
        its path kind, else the kind's prior."""
        learnt = self.bandwidths_b_s.get(f"{path}@{server}") if server else None
        if learnt is None:
            learnt = self.bandwidths_b_s.get(path)
        return learnt if learnt is not None else self.priors_b_s.get(
            path, self.priors_b_s[NETWORK])

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        """A prefill of ``tokens`` tokens took ``seconds``: a sample of its length class
        (module docstring); the recomputes' spread follows its ratio to the prediction."""
        if rate_of(tokens, seconds) is not None:
            with self._lock:
                predicted = self.prefills.seconds(tokens, self.prefill_tok_s)
                self.prefills.add(tokens, seconds)
                self.spread.setdefault(RECOMPUTE, Spread()).add(seconds / predicted, self.alpha)

    def calibrate_prefill(self, tokens: int, seconds: float) -> None:
        """A timed calibration prefill of ``tokens`` tokens: its speed replaces the prior
        and is the first sample of its length class (module docstring)."""
        tok_s = rate_of(tokens, seconds)
        if tok_s is not None:
            with self._lock:
                self.prefill_tok_s = tok_s
                self.calibrated_tokens = tokens
                self.prefills.add(tokens, seconds)

    def calibrate_step(self, seconds: float) -> None:
        """A timed forward of one token after a calibration prefill: the least a hit's
        suffix costs (``suffix_seconds``)."""
        if rate_of(1, seconds) is not None:  # as the other calibrations' times are checked
            with self._lock:
                self.prefills.step_s = seconds

    def calibrate_link(self, bytes_per_s: float, path: str = NETWORK, server: str = "") -> None:
        """A measured bandwidth of ``path`` from ``server`` (``kdn.client.probe``): it replaces
        the prior for the path kind and the server (later retrieves refine it)."""
        if speed(bytes_per_s):
            with self._lock:
                self.bandwidths_b_s[path] = bytes_per_s
                if server:
                    self.bandwidths_b_s[f"{path}@{server}"] = bytes_per_s

    def calibrate_decode(self, encoding: str, kv_bytes: int, seconds: float,
                         device: str | None = None) -> None:
        """A timed decode of ``kv_bytes`` of KV in ``encoding`` on ``device`` (the codec
        alone): it replaces the prior until the first hit decoded in it is seen
        (``observe_decode``), with what hits of other encodings showed they cost beyond
        their codec added (``overhead_s_b``)."""
        codec = rate_of(kv_bytes, seconds)
        if codec is not None:
            with self._lock:
                self.codec_b_s[self._key(encoding, device)] = codec

    def knows_decode(self, encoding: str, device: str | None = None) -> bool:
        """A decode speed of ``encoding`` on ``device`` was seen or calibrated, or its mode
        has a prior there (``DECODE_PRIORS_B_S``): no calibration needed."""
        kind = (device or self.device).split(":")[0]
        key = self._key(encoding, device)
        return (key in self.decode_b_s or key in self.codec_b_s
                or (encoding.split("-")[0], kind) in DECODE_PRIORS_B_S)

    def prefill_seconds(self, tokens: int) -> float:
        """Predicted seconds to prefill ``tokens`` tokens: at the seconds per token of the
        nearest length class with samples (the longer of two as near), else at the prior
        ``prefill_tok_s`` (module docstring)."""
        with self._lock:  # another thread may be adding a length class
            return self.prefills.seconds(tokens, self.prefill_tok_s)

    def suffix_seconds(self, tokens: int) -> float:
        """Predicted seconds to compute the ``tokens`` tokens a hit leaves, after its KV: at
        least one token's forward after a prefill (``calibrate_step``; module docstring)."""
        with self._lock:
            return self.prefills.suffix(tokens, self.prefill_tok_s)

    def observe_ttft(self, predicted_s: float, measured_s: float) -> None:
        """One request's predicted and measured time to first token."""
        if (measured(measured_s) and 0 <= predicted_s < math.inf
                and math.isfinite(predicted_s / measured_s)):
            with self._lock:
                self.ttft_requests += 1
                self.ttft_abs_ratio_sum += abs(predicted_s / measured_s - 1)
                self.last_ttft = (predicted_s, measured_s)

    @property
    def ttft_error(self) -> float:
        """Mean over the observed requests of ``|predicted / measured - 1|`` (0.2: the
        predictions were off by 20% on average); 0 before any."""
        return self.ttft_abs_ratio_sum / self.ttft_requests if self.ttft_requests else 0.0

    def _key(self, encoding: str, device: str | None) -> str:
        return f"{encoding}@{device or self.device}"

    def observe_decode(self, encoding: str, kv_bytes: int, seconds: float,
                       device: str | None = None) -> None:
        """A hit of ``kv_bytes`` of KV in ``encoding`` cost ``seconds`` beyond its transfer on
        ``device``: the first replaces the calibration or prior (what a hit costs end to end
        is what decisions must weigh), later ones are running means. Where the encoding was
        calibrated, what it cost beyond the codec is learnt as the device's overhead."""
        rate = rate_of(kv_bytes, seconds)
        if rate is not None:
            self._learn_decode(encoding, rate, device, replace=False)

    def _learn_decode(self, encoding: str, rate: float, device: str | None,
                      replace: bool) -> None:
        """``encoding`` decodes at ``rate`` (bytes/s of KV, end to end) on ``device``: set so
        (``replace``) or as a running mean (the first one replaces); with a calibration, what
        it costs beyond the codec is the device's overhead."""
        key = self._key(encoding, device)
        with self._lock:
            old = self.decode_b_s.get(key, rate)
            self.decode_b_s[key] = rate if replace else self._ewma(old, rate)
            codec = self.codec_b_s.get(key)
            if codec is not None:
                dev = device or self.device
                extra = max(0.0, 1 / rate - 1 / codec)
                self.overhead_s_b[dev] = extra if replace else self._ewma(
                    self.overhead_s_b.get(dev, extra), extra)

    def observe_hit(self, encoding: str, kv_bytes: int, transfer_s: float, seconds: float,
                    local: bool = False, path: str = NETWORK, server: str = "",
                    device: str | None = None) -> None:
        """A hit of ``kv_bytes`` of KV in ``encoding`` took ``seconds`` from its first request
        to usable KV, ``transfer_s`` of them until its last byte arrived, from the in-process
        tier (``local``) or over ``path`` from ``server``. Its decode time is what makes
        ``estimate`` reproduce ``seconds`` with that transfer (module docstring: decode-bound,
        ``seconds - transfer_s / layers``; transfer-bound, ``layers`` times what showed after
        the last byte); the decode speed learnt from it is robust to one straggler (module
        docstring: one sample moves the estimate at most twofold, two give the faster, three
        and more their median as a running mean); the option's spread follows ``seconds``.
        The bandwidth is ``observe_transfer``'s to learn. A hit lifts a suspension of its
        encoding on that route (``observe_failure``)."""
        if rate_of(kv_bytes, seconds) is None or not math.isfinite(transfer_s):
            return
        t, layers = max(0.0, transfer_s), max(1, self.layers)
        after = max(seconds - t, 0.0)
        decode = (t + after - t / layers if after >= t / layers else layers * after)
        key = option_key(encoding, local, path, server)
        sample = kv_bytes / max(decode, 1e-6)
        with self._lock:
            got = self._recent.setdefault(f"decode:{key}@{device or self.device}", [])
            got.append(sample)
            del got[:-RECENT]
            if len(got) == 1:  # against what it was thought to be: at most twofold either way
                before = self.decode_speed(encoding, device)
                rate = min(2 * before, max(before / 2, math.sqrt(before * sample)))
            else:  # of two, the faster (a straggler is slow); of more, the median
                rate = max(got) if len(got) < RECENT else statistics.median(got)
        self._learn_decode(encoding, rate, device, replace=len(got) < RECENT)
        with self._lock:
            self.spread.setdefault(key, Spread()).add(seconds / kv_bytes, self.alpha)
            self._suspended.pop((route_key(False, path, server), encoding), None)

    def observe_failure(self, encoding: str, path: str = NETWORK, server: str = "") -> None:
        """A load of ``encoding`` over ``path`` from ``server`` failed (the prompt was
        computed whole): the encoding is left out of the next decisions on that route, for
        twice as many after each further failure (``retry_every`` / 4 first, at most
        ``retry_max``), until a hit of it is seen there."""
        route = route_key(False, path, server)
        with self._lock:
            now = self.decisions[route]
            _, gap = self._suspended.get((route, encoding), (0, max(1, self.retry_every // 4)))
            self._suspended[(route, encoding)] = (now + gap, min(2 * gap, max(1, self.retry_max)))

    def decode_speed(self, encoding: str, device: str | None = None) -> float:
        """Decode speed of ``encoding`` on ``device`` (bytes/s) a hit shows: learnt from hits;
        before one, the calibrated codec speed with the device's learnt overhead; else the
        prior of its mode on that kind of device (``DECODE_PRIORS_B_S``), else 1 GB/s."""
        key = self._key(encoding, device)
        learnt = self.decode_b_s.get(key)
        if learnt is not None:
            return learnt
        codec = self.codec_b_s.get(key)
        if codec is not None:
            return 1 / (1 / codec + self.overhead_s_b.get(device or self.device, 0.0))
        kind = (device or self.device).split(":")[0]
        return DECODE_PRIORS_B_S.get((encoding.split("-")[0], kind), 1e9)

    def estimate(self, encoding: str, stored_bytes: int, kv_bytes: int,
                 local: bool = False, path: str = NETWORK, server: str = "") -> float:
        """Seconds to usable KV: transfer over ``path`` from ``server`` (the in-process tier
        for ``local``) and decode on this controller's device, pipelined over ``layers``
        (module docstring)."""
        if local:
            path, server = IN_PROCESS, ""
        share = self.transfer_fits.get(option_key(encoding, local, path, server), 1.0)
        transfer = stored_bytes / (self.bandwidth(path, server) * share)
        decode = kv_bytes / self.decode_speed(encoding)
        return max(transfer, decode) + min(transfer, decode) / max(1, self.layers)

    def error(self, option: str, local: bool = False, path: str = NETWORK,
              server: str = "") -> float | None:
        """Relative scatter of ``option``'s measured cost on that route (an encoding) or of
        the recomputes: None before two observations."""
        got = self.spread.get(option_key(option, local, path, server))
        return got.relative_error if got is not None else None

    def _seen(self, option: str, local: frozenset[str], path: str, server: str) -> int:
        """Times ``option`` was observed on its route (a recompute: anywhere)."""
        got = self.spread.get(option_key(option, option in local, path, server))
        return got.n if got is not None else 0

    def margin(self, a: str, b: str, local: frozenset[str] = frozenset(),
               path: str = NETWORK, server: str = "") -> float:
        """Relative gain needed to prefer option ``b`` to option ``a``: their errors combined,
        within [``margin_min``, ``margin_max``]; an option seen fewer than twice counts
        ``margin_max``."""
        errs = [self.error(o, o in local, path, server) for o in (a, b)]
        combined = math.hypot(*(self.margin_max if e is None else e for e in errs))
        return min(self.margin_max, max(self.margin_min, combined))

    def _retrial(self, route: str, now: int, est: dict[str, float], kept: str,
                 reason: str) -> tuple[str, str]:
        """The option to re-try at decision ``now`` on ``route`` instead of ``kept``, if one
        is due (module docstring), with the reason; else ``kept`` and ``reason``."""
        every = self.retry_every
        if not every or now - self._retried.get(route, -every) < every:
            return kept, reason
        due = [o for o in est if o != kept and est[o] <= self.retry_cost * est[kept]
               and now - self._tried.get((route, o), 0) >= self._gap.get((route, o), every)]
        if not due:
            return kept, reason
        tried = min(due, key=lambda o: self._tried.get((route, o), 0))  # the longest unseen
        gap = self._gap.get((route, tried), every)
        with self._lock:
            self._retried[route] = now
            self._gap[(route, tried)] = min(2 * gap, self.retry_max)
        gain = relative(est[tried], est[kept])
        return tried, (f"re-trying {tried} ({gain:+.1%} against {kept}),"
                       f" not chosen for {now - self._tried.get((route, tried), 0)} decisions")

    def recomputed(self, choice: str) -> None:
        """A load ``choose`` counted as ``choice`` ended in the prompt computed whole: counted
        as a recompute instead (under the lock: engines may share this controller)."""
        with self._lock:
            self.counts[choice] -= 1
            self.counts[RECOMPUTE] += 1

    def choose(self, tokens: int, kv_bytes: int, stored: dict[str, int],
               override: str | None = None, local: frozenset[str] = frozenset(),
               path: str = NETWORK, server: str = "") -> Decision:
        """Pick for ``tokens`` tokens whose KV is ``kv_bytes`` bytes; ``stored`` maps each
        available encoding to its stored size (a missing encoding is simply absent); ``local``
        names the encodings the in-process tier holds; the others come over ``path`` from
        ``server``. Without ``override`` the route's last choice stays unless another
        option beats it by more than ``margin`` (module docstring). An encoding whose load
        failed there is left out for a while (``observe_failure``); an option not chosen for
        a while is re-tried (``retry_every``)."""
        route = route_key(False, path, server)
        offered, now = bool(stored), self.decisions[route]
        if override is None:
            stored = {enc: size for enc, size in stored.items()
                      if self._suspended.get((route, enc), (0, 0))[0] <= now}
        est = {enc: self.estimate(enc, size, kv_bytes, enc in local, path, server)
               for enc, size in stored.items()}
        est[RECOMPUTE] = self.prefill_seconds(tokens)
        if override is not None:
            if override != RECOMPUTE and override not in stored:
                choice, reason = RECOMPUTE, f"override {override!r} not stored; recomputing"
            else:
                choice, reason = override, "override"
        elif not stored:
            choice, reason = RECOMPUTE, ("nothing stored" if not offered else
                                         "every stored encoding failed to load here lately")
        else:
            choice = min(est, key=lambda k: est[k])
            reason = "fastest estimate"
            last = self.last_choice.get(route)
            if last is not None and last != choice and last in est:
                m = self.margin(last, choice, local, path, server)
                if est[choice] > (1 - m) * est[last]:
                    gain = -relative(est[choice], est[last])
                    reason = (f"kept {last}: {choice} is {gain:.1%} "
                              f"faster, within the estimates' error ({m:.1%})")
                    choice = last
        kept = choice
        if override is None and stored and self._seen(choice, local, path, server):
            unseen = [enc for enc in stored if enc != choice
                      and self._seen(enc, local, path, server) < self.trials
                      and est[enc] <= (1 + self.explore) * est[choice]]
            if unseen:
                tried = min(unseen, key=lambda k: est[k])
                reason = (f"trying {tried}: {relative(est[tried], est[choice]):+.1%} against "
                          f"{choice}, seen {self._seen(tried, local, path, server)} times "
                          "here")
                choice = tried
        if override is None and stored and choice == kept:
            choice, reason = self._retrial(route, now, est, kept, reason)
        with self._lock:
            self.counts[choice] += 1
            if override is None and stored:
                self.last_choice[route] = kept  # a trial is not a choice to keep
                self._tried[(route, choice)] = now
                self._gap.pop((route, kept), None)
            if override is None and offered:
                self.decisions[route] += 1
        log.info("controller: %d tokens -> %s (%s; estimates %s)", tokens, choice, reason,
                 {k: round(v, 4) for k, v in est.items()})
        return Decision(choice, est, reason)
