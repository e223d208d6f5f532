"""What the server served, in the units operators chart: tokens, by tier, tenant and model.

The servicers record each stored entry, each entry a read asked for (found or not) and each
one served (with the tier it came from and how long the store took to read it); the
Prometheus collector (``kdn.server.observe``) turns the counts into metric families at scrape
time:

    kdn_tokens_stored_total{tenant, model}         tokens of the entries stored
    kdn_tokens_served_total{tier, tenant, model}   tokens of the entries served, by tier
    kdn_entries_requested_total{tenant, result}    entries reads asked for: hit or miss
    kdn_bytes_stored_total{encoding}               stored bytes by codec (mode-level)
    kdn_bytes_served_total{encoding}
    kdn_tier_read_seconds{tier}                    the store's read of one entry (histogram)

The hit ratio by tenant is ``hit / (hit + miss)`` of the requested entries; by model, the
tokens served over the tokens stored. Labels stay bounded: tenants come from the auth file,
and after ``MAX_MODELS`` distinct model names the rest count as ``other``. An entry's tokens,
model and encoding are read from its header once and remembered per key (a read path that
does not parse headers, GetMany, looks them up there).
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from kdn.codec.format import Header, parse_header
from kdn.errors import KDNError
from kdn.keys import split_store_key

MAX_MODELS = 32
MAX_REMEMBERED = 100_000
READ_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0, 2.5)

Facts = tuple[int, str, str]  # tokens, model, encoding


class Usage:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._facts: OrderedDict[bytes, Facts] = OrderedDict()
        self._models: set[str] = set()
        self.stored_tokens: dict[tuple[str, str], int] = {}
        self.served_tokens: dict[tuple[str, str, str], int] = {}
        self.requested: dict[tuple[str, str], int] = {}
        self.stored_bytes: dict[str, int] = {}
        self.served_bytes: dict[str, int] = {}
        self.reads: dict[str, list[float]] = {}  # tier -> [bucket counts..., sum, count]

    # -- facts of an entry --------------------------------------------------------------------

    def _model(self, name: str) -> str:
        if name in self._models or len(self._models) < MAX_MODELS:
            self._models.add(name)
            return name
        return "other"

    def _remember(self, skey: bytes, header: Header) -> Facts:
        codec = header.entry.codec
        encoding = f"{codec.mode}-{codec.level}" if codec.level else codec.mode
        model = header.layout.model_name or header.layout.model_fingerprint[:16]
        facts = (header.tokens, model, encoding)
        with self._lock:
            facts = (facts[0], self._model(facts[1]), facts[2])
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
            return self._remember(skey, parse_header(value))
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

    def missed(self, skey: bytes) -> None:
        tenant = split_store_key(skey)[0]
        with self._lock:
            self.requested[(tenant, "miss")] = self.requested.get((tenant, "miss"), 0) + 1

    def served(self, skey: bytes, value: Any, tier: str, read_s: float,
               header: Header | None = None) -> None:
        facts = self._facts_of(skey, value, header)
        tenant = split_store_key(skey)[0]
        with self._lock:
            self.requested[(tenant, "hit")] = self.requested.get((tenant, "hit"), 0) + 1
            h = self.reads.setdefault(tier, [0.0] * (len(READ_BUCKETS) + 2))
            h[bisect.bisect_left(READ_BUCKETS, read_s)] += 1
            h[-2] += read_s
            h[-1] += 1
            if facts is None:
                return
            tokens, model, encoding = facts
            key3 = (tier, tenant, model)
            self.served_tokens[key3] = self.served_tokens.get(key3, 0) + tokens
            self.served_bytes[encoding] = self.served_bytes.get(encoding, 0) + len(value)

    # -- metrics --------------------------------------------------------------------------------

    def families(self) -> Iterable[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        with self._lock:
            stored = dict(self.stored_tokens)
            served = dict(self.served_tokens)
            requested = dict(self.requested)
            bytes_in, bytes_out = dict(self.stored_bytes), dict(self.served_bytes)
            reads = {t: list(h) for t, h in self.reads.items()}
        fam = CounterMetricFamily("kdn_tokens_stored", "Tokens of the entries stored",
                                  labels=["tenant", "model"])
        for (tenant, model), n in stored.items():
            fam.add_metric([tenant, model], float(n))
        yield fam
        fam = CounterMetricFamily("kdn_tokens_served", "Tokens of the entries served, by the "
                                  "tier they came from", labels=["tier", "tenant", "model"])
        for (tier, tenant, model), n in served.items():
            fam.add_metric([tier, tenant, model], float(n))
        yield fam
        fam = CounterMetricFamily("kdn_entries_requested", "Entries reads asked for, found "
                                  "(hit) or not (miss)", labels=["tenant", "result"])
        for (tenant, result), n in requested.items():
            fam.add_metric([tenant, result], float(n))
        yield fam
        for name, what, data in (("kdn_bytes_stored", "Bytes stored, by encoding", bytes_in),
                                 ("kdn_bytes_served", "Bytes served, by encoding", bytes_out)):
            fam = CounterMetricFamily(name, what, labels=["encoding"])
            for encoding, n in data.items():
                fam.add_metric([encoding], float(n))
            yield fam
        hist = HistogramMetricFamily("kdn_tier_read_seconds", "The store's read of one entry "
                                     "(tier read and checks), by the tier that had it",
                                     labels=["tier"])
        for tier, h in reads.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip((*READ_BUCKETS, float("inf")), h[:-2]):
                cumulative += count
                buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
            hist.add_metric([tier], buckets, sum_value=h[-2])
        yield hist
