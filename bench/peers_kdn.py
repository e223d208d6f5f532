"""kdn as a ``bench.peers`` system: its server (``kdn serve``, RAM tier only), the ``Client``
options of each kdn column, and ``Kdn``: every store and read route kdn offers (a user's
KVCache, encoded parts, staged entries, async stores; single, batch and looped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.common import free_port
from bench.common import kdn_server as common_kdn_server
from bench.peers_systems import HEAD_DIM, KV_HEADS, MIB, MODEL, Route, System
from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.codec.format import EncodedParts, build_header, parse_header
from kdn.layout import KVLayout, LayerLayout

STAGED_BYTES = 128 * MIB
"""Bytes of staged entries kdn fills per size (one per entry up to this; beyond, entry i
stores staged entry i modulo their number)."""
SERVER_RAM_GIB = 6
"""kdn's RAM tier in this benchmark."""


def parse_opts(text: str) -> dict[str, Any]:
    """``"shm_bytes=0,local_bytes=268435456"`` as Client keyword arguments."""
    out: dict[str, Any] = {}
    for item in filter(None, (x.strip() for x in text.split(","))):
        k, _, v = item.partition("=")
        val: Any = v
        if v.lower() in ("true", "false", "none"):
            val = {"true": True, "false": False, "none": None}[v.lower()]
        else:
            for cast in (int, float):
                try:
                    val = cast(v)
                    break
                except ValueError:
                    pass
        out[k.strip()] = val
    return out


@contextmanager
def kdn_server(tmp: Path, extra: list[str]) -> Iterator[str]:
    with common_kdn_server(tmp / f"kdn-{free_port()}", "--ram-bytes", f"{SERVER_RAM_GIB}GiB",
                           "--max-message-bytes", str(256 * MIB),
                           "--max-entry-bytes", str(1 << 30), *extra) as address:
        yield address


def llama_layout(layers: int) -> KVLayout:
    return KVLayout(MODEL, tuple(LayerLayout(KV_HEADS, HEAD_DIM, HEAD_DIM)
                                 for _ in range(layers)), head_dim=HEAD_DIM)


class Kdn(System):
    """kdn through ``kdn.client.Client(**opts)``; single calls, and the batch calls where the
    client has them (``store_many``/``fetch_many``), else a loop of single calls."""

    def __init__(self, address: str, opts: dict[str, Any], tag: int,
                 layers_per_frame: int, server_args: str = "") -> None:
        label = ",".join(f"{k}={v}" for k, v in opts.items())
        self.name = (f"kdn[{label}]" if label else "kdn") + \
            (f"{{{server_args.strip()}}}" if server_args.strip() else "")
        self.tag, self.layers_per_frame = tag, layers_per_frame
        self.client = Client(address, max_message_bytes=256 * MIB, **opts)
        self.staged: list[Any] = []
        self.earlier: list[bytes] = []  # keys of earlier workloads

    def load(self, kv: torch.Tensor, count: int, slots: int) -> None:
        _, layers, tokens, _ = kv.shape
        self.layout = llama_layout(layers)
        # K, V per layer: [kv_heads, tokens, head_dim], from kv[0 or 1, layer]: [tokens, hidden]
        def head_major(t: torch.Tensor) -> torch.Tensor:
            return t.view(tokens, KV_HEADS, HEAD_DIM).transpose(0, 1).contiguous()

        self.kv = KVCache(self.layout, [(head_major(kv[0, layer]), head_major(kv[1, layer]))
                                        for layer in range(layers)])
        self.parts = codec.encode_parts(self.kv, "raw", layers_per_frame=self.layers_per_frame)
        self.frames = b"".join(self.parts.frames)
        # each key's entry its own: the same KV at position i (as chunks of a user's prompts
        # differ), so no header is the same twice and none is parsed from a memo of it; the
        # frames (their sums do not depend on the position) are shared, not copied
        entry = parse_header(self.parts.header).entry
        self.parts_at = []
        for i in range(slots):
            entry.start_position = i
            self.parts_at.append(EncodedParts(build_header(entry), self.parts.frames))
        # the KVCache a user hands over, at each position (the tensors shared)
        self.kv_at = [dataclasses.replace(self.kv, start_position=i) for i in range(slots)]
        self.earlier += getattr(self, "keys", [])  # what ``_clear`` deletes too
        self.keys = [keys.chunk_key([self.tag, self.workload, kv.numel(), i], self.layout)
                     for i in range(slots)]
        for st in self.staged:
            st.close()
        self.staged = []
        if hasattr(self.client, "stage"):  # filled once, as Mooncake's registered buffers are
            for i in range(max(1, min(count, STAGED_BYTES // max(1, self.parts.nbytes)))):
                st = self.client.stage(self.layout, tokens, start_position=i)
                for (k, v), (a, b) in zip(st.layers, self.kv.layers):
                    k.copy_(a)
                    v.copy_(b)
                self.staged.append(st)

    def unload(self) -> None:
        for st in self.staged:
            st.close()
        self.staged = []

    # the small functions a faster client path slots into
    def put_one(self, i: int) -> None:
        self.client.store(self.keys[i], self.parts_at[i])

    def put_kv(self, i: int) -> None:
        """The documented API: a KVCache, encoded (``raw``) by the store."""
        self.client.store(self.keys[i], self.kv_at[i], mode="raw")

    def put_encode_then_store(self, i: int) -> None:
        """What ``store(KVCache)`` did before it wrote into the segment: encode, then store."""
        self.client.store(self.keys[i], codec.encode_parts(self.kv_at[i], "raw",
                                                           layers_per_frame=0, wire=True))

    def put_staged(self, i: int) -> None:
        self.client.store(self.keys[i], self.staged[i % len(self.staged)])

    def put_async(self, i: int) -> None:
        self.client.store_async(self.keys[i], self.parts_at[i])

    def put_async_staged(self, i: int) -> None:
        self.client.store_async(self.keys[i], self.staged[i % len(self.staged)])

    def put_async_loop(self, base: int, n: int, staged: bool) -> None:
        for i in range(base, base + n):
            self.put_async_staged(i) if staged else self.put_async(i)

    def put_staged_batch(self, base: int, n: int) -> None:
        self.client.store_many([(self.keys[base + i], self.staged[i % len(self.staged)])
                                for i in range(n)])

    def get_one(self, i: int) -> Any:
        return self.client.fetch(self.keys[i], layout=self.layout)

    def put_batch(self, base: int, n: int) -> None:
        self.client.store_many(list(zip(self.keys[base:base + n],
                                        self.parts_at[base:base + n])))

    def put_kv_batch(self, base: int, n: int) -> None:
        self.client.store_many(list(zip(self.keys[base:base + n], self.kv_at[base:base + n])),
                               mode="raw")

    def put_encode_then_store_batch(self, base: int, n: int) -> None:
        self.client.store_many([(self.keys[i], codec.encode_parts(
            self.kv_at[i], "raw", layers_per_frame=0, wire=True)) for i in range(base, base + n)])

    def get_batch(self, base: int, n: int) -> list[Any]:
        return list(self.client.fetch_many(self.keys[base:base + n], layout=self.layout))

    def retrieve_one(self, i: int) -> Any:
        return self.client.retrieve(self.keys[i], layout=self.layout)

    def _check(self, i: int, got: Any) -> bool:
        if isinstance(got, KVCache):
            return got.start_position == i and got.equal(
                dataclasses.replace(self.kv, start_position=i))
        return (got is not None and bytes(got.parts.header) == self.parts_at[i].header
                and b"".join(bytes(f) for f in got.parts.frames) == self.frames)

    def _clear(self) -> None:
        gone = self.earlier + self.keys[:self.next_index]
        for at in range(0, len(gone), 1000):
            self.client.delete(gone[at:at + 1000])
        self.earlier = []

    def routes(self) -> list[Route]:
        out = [Route("store", self.put_one, {"fetch": self.get_one,
                                             "retrieve": self.retrieve_one},
                     self._check, clear=self._clear),
               Route("store(KVCache)", self.put_kv, {}, self._check, clear=self._clear),
               Route("encode_parts+store", self.put_encode_then_store, {}, self._check,
                     clear=self._clear)]
        if self.staged:
            out.append(Route("store (staged)", self.put_staged, {}, self._check,
                             clear=self._clear))
        out.append(Route("store_async", self.put_async, {}, self._check,
                         flush=self.client.flush, clear=self._clear))
        if self.staged:
            out.append(Route("store_async (staged)", self.put_async_staged, {},
                             self._check, flush=self.client.flush, clear=self._clear))
        return out

    def batch_routes(self) -> list[Route]:
        gets: dict[str, Callable[..., Any]] = {
            "fetch_many": self.get_batch,
            "retrieve_many": lambda base, n: self.client.retrieve_many(
                self.keys[base:base + n], layout=self.layout)}

        def check(base: int, gots: list[Any]) -> bool:
            return all(self._check(base + j, g) for j, g in enumerate(gots))

        out = [Route("store_many", self.put_batch, gets, check, clear=self._clear),
               Route("store_many(KVCache)", self.put_kv_batch, {}, check, clear=self._clear),
               Route("encode_parts+store_many", self.put_encode_then_store_batch, {}, check,
                     clear=self._clear)]
        if self.staged:
            out.append(Route("store_many (staged)", self.put_staged_batch, {},
                             lambda n, gots: True, clear=self._clear))
        out.append(Route("store_async (loop)", lambda base, n: self.put_async_loop(
            base, n, False), {}, lambda n, gots: True, flush=self.client.flush,
            clear=self._clear))
        if self.staged:
            out.append(Route("store_async (staged, loop)",
                             lambda base, n: self.put_async_loop(base, n, True), {},
                             lambda n, gots: True, flush=self.client.flush,
                             clear=self._clear))
        return out

    def close(self) -> None:
        self.client.close()
