"""What the server served, in the units operators chart: tokens, by tier, tenant and model.

The servicers record each stored entry, each entry a read asked for (found or not) and each
one served (with the tier it came from and how long the store took to read it); the
Prometheus collector (``kdn.server.observe``) turns the counts into metric families at scrape
time:

    kdn_tokens_requested_total{tenant, model}      tokens of the entries reads asked for
    kdn_tokens_served_total{tier, tenant, model}   tokens of the entries served, by tier
    kdn_tokens_stored_total{tenant, model}         tokens of the entries stored
    kdn_entries_requested_total{tenant, model, result}   entries reads asked for: hit or miss
    kdn_bytes_stored_total{encoding}               stored bytes by codec (mode-level)
    kdn_bytes_served_total{encoding}
    kdn_tier_read_seconds{tier}                    the store's read of one entry (histogram)
    kdn_entry_check_seconds{encoding}              the check of one entry stored (histogram)
    kdn_fastpath_requests_total{rpc, code}         calls on the same-host fast path and the
                                                   network data path (rpc NetGetMany, NetPutMany)
    kdn_fastpath_request_seconds{rpc}              (both bypass gRPC and its interceptor)
    kdn_egress_delayed_bytes_total{tenant}         bytes an egress cap held back before sending
    kdn_egress_wait_seconds_total{tenant}          and the time they waited (kdn.server.egress)
    kdn_egress_cancelled_bytes_total{tenant}       bytes held back until their call ended (its
                                                   deadline or its client gone), never sent

The token hit ratio by tenant or model is ``kdn_tokens_served_total`` over
``kdn_tokens_requested_total`` (LMCache's hit tokens over requested tokens). A read names a
key, not a token count, so the tokens of a miss are known only for a key this server has
stored (an entry evicted, expired or deleted since: the misses a larger or longer-lived cache
would have served); a key never stored here (a compulsory miss: new content) is counted in
``kdn_entries_requested_total{model="unknown", result="miss"}`` and adds no tokens. The entry
hit ratio counts both.

Labels stay bounded: tenants come from the auth configuration, encodings from the codec
catalog, tiers and RPCs from the server; after ``MAX_MODELS`` distinct model names the rest
count as ``other``, and one tenant adds at most ``MODELS_PER_TENANT`` of them (a model named
by a local path is labelled with its last component). An
entry's tokens, model and encoding are read from its header once and remembered per key (the
last ``MAX_REMEMBERED`` keys): a read path that does not parse headers, GetMany, looks them up.
"""

from __future__ import annotations

import bisect
import sys
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kdn.codec.format import Header, parse_header
from kdn.errors import KDNError
from kdn.keys import split_store_key
from kdn.store.framed import Framed

MAX_MODELS = 32
MODELS_PER_TENANT = 8
"""Model labels one tenant's entries may add (so one tenant's odd names can not take every
label and leave another's models counted as ``other``)."""
MAX_REMEMBERED = 100_000
UNKNOWN = "unknown"
"""The model label of a miss on a key this server never stored."""
READ_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                0.1, 0.25, 0.5, 1.0, 2.5)

Facts = tuple[int, str, str]  # tokens, model, encoding


class _Histogram:
    """Observations by one label, exported as a Prometheus histogram (not locked: the caller
    holds ``Usage._lock``)."""

    def __init__(self, buckets: tuple[float, ...] = READ_BUCKETS) -> None:
        self.buckets = buckets
        self.data: dict[str, list[float]] = {}  # label -> [bucket counts..., sum, count]

    def observe(self, label: str, seconds: float) -> None:
        h = self.data.setdefault(label, [0.0] * (len(self.buckets) + 3))
        h[bisect.bisect_left(self.buckets, seconds)] += 1
        h[-2] += seconds
        h[-1] += 1

    def family(self, name: str, what: str, label: str, data: dict[str, list[float]]) -> Any:
        from prometheus_client.core import HistogramMetricFamily

        hist = HistogramMetricFamily(name, what, labels=[label])
        for value, h in data.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip((*self.buckets, float("inf")), h[:-2]):
                cumulative += count
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            hist.add_metric([value], buckets, sum_value=h[-2])
        return hist


def model_label(name: str) -> str:
    """A model's label: its name as stored, a local path's last component (the model column
    must not carry a client's directories), at most 64 characters."""
    if name.startswith(("/", "./", "../", "~")) or "\\" in name:
        name = name.replace("\\", "/").rstrip("/").rsplit("/", 1)[-1] or name
    return name[:64]


class Usage:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._facts: OrderedDict[bytes, Facts] = OrderedDict()
        self._models: set[str] = set()
        self._added: dict[str, int] = {}  # model labels each tenant added
        self.stored_tokens: dict[tuple[str, str], int] = {}
        self.requested_tokens: dict[tuple[str, str], int] = {}
        self.served_tokens: dict[tuple[str, str, str], int] = {}
        self.requested: dict[tuple[str, str, str], int] = {}  # (tenant, model, hit|miss)
        self.stored_bytes: dict[str, int] = {}
        self.served_bytes: dict[str, int] = {}
        self.reads = _Histogram()  # by tier
        self.checks = _Histogram()  # by encoding
        self.fast_calls: dict[tuple[str, str], int] = {}  # (rpc, code)
        self.fast_seconds = _Histogram()  # by rpc
        self.egress_delayed_bytes: dict[str, int] = {}  # by tenant
        self.egress_wait_s: dict[str, float] = {}  # by tenant
        self.egress_cancelled_bytes: dict[str, int] = {}  # by tenant

    # -- facts of an entry --------------------------------------------------------------------

    def _model(self, name: str, tenant: str) -> str:
        """``name``'s label (caller locks): itself once labelled, or while there is room for
        it (``MAX_MODELS``, ``MODELS_PER_TENANT``), else ``other``."""
        if name in self._models:
            return name
        added = self._added.get(tenant, 0)
        if len(self._models) < MAX_MODELS and (added < MODELS_PER_TENANT or not tenant):
            # (a server without tenants keeps every key under "": the whole budget is its)
            self._models.add(name)
            self._added[tenant] = added + 1
            return name
        return "other"

    def _remember(self, skey: bytes, header: Header) -> Facts:
        codec = header.entry.codec
        # interned: the 100k remembered facts share a few strings, not one copy each
        encoding = sys.intern(f"{codec.mode}-{codec.level}" if codec.level else codec.mode)
        model = sys.intern(model_label(header.layout.model_name
                                       or header.layout.model_fingerprint[:16]))
        tenant = split_store_key(skey)[0]
        with self._lock:
            facts = (header.tokens, self._model(model, tenant), encoding)
            self._facts[skey] = facts
            self._facts.move_to_end(skey)
            while len(self._facts) > MAX_REMEMBERED:
                self._facts.popitem(last=False)
        return facts

    def _facts_of(self, skey: bytes, value: Any, header: Header | None) -> Facts | None:
        if header is not None:
            return self._remember(skey, header)
        with self._lock:
            got = self._facts.get(skey)
        if got is not None:
            return got
        try:
            return self._remember(skey, parse_header(
                value.header if isinstance(value, Framed) else value))
        except KDNError:
            return None

    # -- events ---------------------------------------------------------------------------------

    def stored(self, skey: bytes, header: Header, nbytes: int) -> None:
        tokens, model, encoding = self._remember(skey, header)
        tenant = split_store_key(skey)[0]
        with self._lock:
            key = (tenant, model)
            self.stored_tokens[key] = self.stored_tokens.get(key, 0) + tokens
            self.stored_bytes[encoding] = self.stored_bytes.get(encoding, 0) + nbytes

    def checked(self, header: Header, seconds: float) -> None:
        """The server checked an entry it was asked to store (header, every frame's checksum
        and shapes) in ``seconds``."""
        codec = header.entry.codec
        encoding = f"{codec.mode}-{codec.level}" if codec.level else codec.mode
        with self._lock:
            self.checks.observe(encoding, seconds)

    def missed(self, skey: bytes) -> None:
        tenant = split_store_key(skey)[0]
        with self._lock:
            facts = self._facts.get(skey)  # stored here before: its tokens are known
            model = facts[1] if facts is not None else UNKNOWN
            key = (tenant, model, "miss")
            self.requested[key] = self.requested.get(key, 0) + 1
            if facts is not None:
                self.requested_tokens[(tenant, model)] = \
                    self.requested_tokens.get((tenant, model), 0) + facts[0]

    def served(self, skey: bytes, value: Any, tier: str, read_s: float | None,
               header: Header | None = None) -> None:
        facts = self._facts_of(skey, value, header)
        tenant = split_store_key(skey)[0]
        with self._lock:
            if read_s is not None:  # (None: a read the store did not make)
                self.reads.observe(tier, read_s)
            tokens, model, encoding = facts if facts is not None else (0, UNKNOWN, "")
            key = (tenant, model, "hit")
            self.requested[key] = self.requested.get(key, 0) + 1
            if facts is None:
                return
            self.requested_tokens[(tenant, model)] = \
                self.requested_tokens.get((tenant, model), 0) + tokens
            key3 = (tier, tenant, model)
            self.served_tokens[key3] = self.served_tokens.get(key3, 0) + tokens
            self.served_bytes[encoding] = self.served_bytes.get(encoding, 0) + len(value)

    def fast_call(self, rpc: str, code: str, seconds: float) -> None:
        """One call on the same-host fast path (``kdn.server.fastpath``), which the gRPC
        interceptor (``kdn_requests_total``, ``kdn_request_seconds``) never sees."""
        with self._lock:
            self.fast_calls[(rpc, code)] = self.fast_calls.get((rpc, code), 0) + 1
            self.fast_seconds.observe(rpc, seconds)

    def paced(self, tenant: str, nbytes: int, seconds: float) -> None:
        """An egress cap (``kdn.server.egress``) held ``nbytes`` for ``tenant`` back for
        ``seconds`` before they were sent."""
        with self._lock:
            self.egress_delayed_bytes[tenant] = self.egress_delayed_bytes.get(tenant, 0) + nbytes
            self.egress_wait_s[tenant] = self.egress_wait_s.get(tenant, 0.0) + seconds

    def pace_cancelled(self, tenant: str, nbytes: int) -> None:
        """A call of ``tenant`` ended (its deadline, its client gone) while an egress cap held
        ``nbytes`` of it back: they were never sent."""
        with self._lock:
            self.egress_cancelled_bytes[tenant] = \
                self.egress_cancelled_bytes.get(tenant, 0) + nbytes

    # -- metrics --------------------------------------------------------------------------------

    def families(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily

        with self._lock:
            stored, asked = dict(self.stored_tokens), dict(self.requested_tokens)
            served = dict(self.served_tokens)
            requested = dict(self.requested)
            bytes_in, bytes_out = dict(self.stored_bytes), dict(self.served_bytes)
            reads = {t: list(h) for t, h in self.reads.data.items()}
            checks = {e: list(h) for e, h in self.checks.data.items()}
            calls = dict(self.fast_calls)
            fast = {r: list(h) for r, h in self.fast_seconds.data.items()}
            delayed, waited = dict(self.egress_delayed_bytes), dict(self.egress_wait_s)
            cancelled = dict(self.egress_cancelled_bytes)
        for name, what, data in (
                ("kdn_tokens_requested", "Tokens of the entries reads asked for (a miss on a "
                 "key never stored here adds none: its size is unknown)", asked),
                ("kdn_tokens_stored", "Tokens of the entries stored", stored)):
            fam = CounterMetricFamily(name, what, labels=["tenant", "model"])
            for (tenant, model), n in data.items():
                fam.add_metric([tenant, model], float(n))
            yield fam
        fam = CounterMetricFamily("kdn_tokens_served", "Tokens of the entries served, by the "
                                  "tier they came from", labels=["tier", "tenant", "model"])
        for (tier, tenant, model), n in served.items():
            fam.add_metric([tier, tenant, model], float(n))
        yield fam
        fam = CounterMetricFamily("kdn_entries_requested", "Entries reads asked for, found "
                                  "(hit) or not (miss); model unknown: a key never stored here",
                                  labels=["tenant", "model", "result"])
        for (tenant, model, result), n in requested.items():
            fam.add_metric([tenant, model, result], float(n))
        yield fam
        for name, what, data2 in (("kdn_bytes_stored", "Bytes stored, by encoding", bytes_in),
                                  ("kdn_bytes_served", "Bytes served, by encoding", bytes_out)):
            fam = CounterMetricFamily(name, what, labels=["encoding"])
            for encoding, n in data2.items():
                fam.add_metric([encoding], float(n))
            yield fam
        yield self.reads.family("kdn_tier_read_seconds", "The store's read of one entry (tier "
                                "read and checks), by the tier that had it", "tier", reads)
        yield self.checks.family("kdn_entry_check_seconds", "The server's check of one entry "
                                 "it stores (container header, every frame's checksum and "
                                 "shapes; from a shared segment, the copy checked as it is "
                                 "made), by encoding: the server never decodes tensors",
                                 "encoding", checks)
        fam = CounterMetricFamily("kdn_fastpath_requests", "Calls on the same-host fast path "
                                  "(GetMany/PutMany over a unix socket, outside gRPC), by "
                                  "status code", labels=["rpc", "code"])
        for (rpc, code), n in calls.items():
            fam.add_metric([rpc, code], float(n))
        yield fam
        yield self.fast_seconds.family("kdn_fastpath_request_seconds", "Latency of calls on "
                                       "the same-host fast path", "rpc", fast)
        for name, what, data3 in (
                ("kdn_egress_delayed_bytes", "Bytes an egress cap (egress_bytes_per_s) held "
                 "back before sending them", delayed),
                ("kdn_egress_wait_seconds", "Time the bytes an egress cap held back waited",
                 waited),
                ("kdn_egress_cancelled_bytes", "Bytes an egress cap held back until their call "
                 "ended (its deadline, its client gone): never sent", cancelled)):
            fam = CounterMetricFamily(name, what, labels=["tenant"])
            for tenant, v in data3.items():
                fam.add_metric([tenant], float(v))
            yield fam
