"""The client facing a server that does not keep its side of the protocol: one that ignores
what a read expects of its entry (an older server, or one at odds with the client), answers
another key's entry, cuts its answers short, or fails slowly. Each is a typed kdn error within
the call's deadline, and an engine computes the prompt whole, to the no-cache output.

The server here is a real one behind a gRPC servicer that forwards every call and tampers
with what the test names (``Lying``); the client gets no shared segment from it (Attach is
UNIMPLEMENTED), so every read goes over gRPC."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from kdn import keys
from kdn.client import AsyncClient, Client
from kdn.engine import EngineConfig, KDNEngine
from kdn.errors import Corrupt, DeadlineExceeded, LayoutMismatch, Unavailable
from kdn.server import ServerConfig, ServerThread
from kdn.v1 import kdn_pb2_grpc as pb_grpc
from tests.helpers import numbered_key, random_kv, uniform_layout
from tests.test_engine_devices import _model, _Tok

MAX = 64 << 20
OPTIONS = [("grpc.max_receive_message_length", MAX), ("grpc.max_send_message_length", MAX)]
EXPECTS = ("expect_layout_fingerprint", "expect_tokens")
LONG, OTHER, FINE, J = (numbered_key(i) for i in range(4))


class Lying(pb_grpc.KDNServicer):
    """Forwards to ``upstream`` with no expectations of the entries read (as a server that
    checks none), reading ``swap[key]`` where a read names ``key``; ``short_lookup``: one
    info fewer than the keys asked; ``short_getmany``: one entry fewer than the keys asked;
    ``headless``: a Retrieve ends at once, OK;
    ``unavailable_after_s``: every Lookup fails UNAVAILABLE after that long."""

    def __init__(self, upstream: str) -> None:
        self.channel = grpc.insecure_channel(upstream, options=OPTIONS)
        self.stub = pb_grpc.KDNStub(self.channel)
        self.swap: dict[bytes, bytes] = {}
        self.short_lookup = False
        self.short_getmany = False
        self.headless = False
        self.unavailable_after_s: float | None = None
        self.lookups = 0

    def _read(self, req: Any) -> Any:
        out = type(req)()
        out.CopyFrom(req)
        for name in EXPECTS:
            if name in type(req).DESCRIPTOR.fields_by_name:
                out.ClearField(name)
        if "key" in type(req).DESCRIPTOR.fields_by_name:
            out.key = self.swap.get(out.key, out.key)
        if "keys" in type(req).DESCRIPTOR.fields_by_name:
            swapped = [self.swap.get(k, k) for k in out.keys]
            del out.keys[:]
            out.keys.extend(swapped)
        return out

    def _forward(self, name: str, req: Any, context: grpc.ServicerContext) -> Any:
        try:
            return getattr(self.stub, name)(req)
        except grpc.RpcError as err:
            context.abort(err.code(), err.details())

    def Attach(self, req: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "no shared segment through this one")

    def Lookup(self, req: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        self.lookups += 1
        if self.unavailable_after_s is not None:
            time.sleep(self.unavailable_after_s)
            context.abort(grpc.StatusCode.UNAVAILABLE, "gone away")
        resp = self._forward("Lookup", req, context)
        if self.short_lookup:
            del resp.infos[-1]
        return resp

    def GetMany(self, req: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        resp = self._forward("GetMany", self._read(req), context)
        if self.short_getmany:
            del resp.entries[-1]
        return resp

    def Retrieve(self, req: Any, context: grpc.ServicerContext) -> Iterator[Any]:  # noqa: N802
        if self.headless:
            return
        yield from self._forward("Retrieve", self._read(req), context)

    def RetrieveMany(self, req: Any, context: grpc.ServicerContext  # noqa: N802
                     ) -> Iterator[Any]:
        yield from self._forward("RetrieveMany", self._read(req), context)

    def Store(self, it: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._forward("Store", it, context)

    def StoreMany(self, it: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._forward("StoreMany", it, context)

    def PutMany(self, req: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._forward("PutMany", req, context)

    def Stats(self, req: Any, context: grpc.ServicerContext) -> Any:  # noqa: N802
        return self._forward("Stats", req, context)


@pytest.fixture
def lying(tmp_path: Path) -> Iterator[tuple[Lying, str, str]]:
    """(the lying servicer, its address, the real server's address)."""
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=256 << 20)
    with ServerThread(cfg) as real:
        servicer = Lying(real.address)
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=OPTIONS)
        pb_grpc.add_KDNServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield servicer, f"127.0.0.1:{port}", real.address
        finally:
            server.stop(0)
            servicer.channel.close()


def test_an_entry_of_another_shape_is_refused_on_every_read(
        lying: tuple[Lying, str, str]) -> None:
    """The server asks nothing of the entries it answers: the client refuses one of other
    tokens or another layout on each read that names what it expects, before decoding it."""
    _, address, real = lying
    layout = uniform_layout()
    with Client(real) as c:
        c.store(LONG, random_kv(layout, 64), mode="raw")
        c.store(OTHER, random_kv(uniform_layout(dim=8), 32), mode="raw")
        c.store(FINE, random_kv(layout, 32), mode="raw")
    with Client(address) as c:
        assert c.retrieve(FINE, layout=layout, tokens=32) is not None
        for key, says in ((LONG, "holds 64 tokens"), (OTHER, "has layout")):
            reads = {
                "retrieve": lambda k=key: c.retrieve(k, layout=layout, tokens=32),
                "retrieve_stream": lambda k=key: c.retrieve_stream(k, layout=layout, tokens=32),
                "fetch": lambda k=key: c.fetch(k, layout=layout, tokens=32),
                "fetch_many": lambda k=key: c.fetch_many([FINE, k], layout=layout,
                                                         tokens=32),
                "retrieve_many": lambda k=key: c.retrieve_many([FINE, k], layout=layout,
                                                               tokens=32),
                "retrieve_streams": lambda k=key: c.retrieve_streams([FINE, k],
                                                                     layout=layout, tokens=32),
            }
            for what, read in reads.items():
                with pytest.raises(LayoutMismatch, match=says):
                    read()
                    pytest.fail(f"{what} of {key!r} was not refused")


def test_an_engine_answered_another_blocks_kv_computes_the_prompt(
        lying: tuple[Lying, str, str]) -> None:
    """Block 1's key answered with block 0's entry (the same shape, the KV of other
    positions): the engine sees the position, computes the prompt whole, and gives the
    no-cache output."""
    servicer, address, _ = lying
    prompt = [int(x) for x in torch.randint(1, 256, (100,),
                                            generator=torch.Generator().manual_seed(5))]
    with Client(address) as c:
        engine = KDNEngine(_model(torch.float32, "cpu"), _Tok(), c,
                           EngineConfig(chunk_tokens=32, encodings=(("raw", ""),),
                                        calibrate=False))
        full = engine.generate(prompt, max_new_tokens=6)
        engine.wait_for_save(60)
        chain = [keys.variant_key(k, "raw") for k in engine._chain(prompt)]  # noqa: SLF001
        servicer.swap[chain[1]] = chain[0]
        got = engine.generate(prompt, max_new_tokens=6, force="raw")
    assert got.timings.reused_tokens == 0
    assert "block loaded for tokens 32..64 holds the KV of tokens 0..32" in \
        got.timings.load_error
    assert got.token_ids == full.token_ids


def test_answers_cut_short_are_corrupt_also_to_the_async_client(
        lying: tuple[Lying, str, str]) -> None:
    """A Lookup or GetMany answering fewer keys than asked, a Retrieve ending before its
    header: Corrupt, and the AsyncClient's awaits end with it (a StopIteration can not be set
    on a future: the await never ended)."""
    servicer, address, real = lying
    with Client(real) as c:
        c.store(FINE, random_kv(uniform_layout(), 8), mode="raw")
    servicer.short_lookup = servicer.headless = servicer.short_getmany = True
    with Client(address) as c:
        with pytest.raises(Corrupt, match="Lookup answered 1 keys of the 2 asked"):
            c.lookup([FINE, J])
        with pytest.raises(Corrupt, match="GetMany answered 0 entries for 1 keys"):
            c.fetch(FINE)  # not a miss
        with pytest.raises(Corrupt, match="where its header was due"):
            c.retrieve_stream(FINE)

    async def main() -> None:
        async with AsyncClient(address) as ac:
            for call in (ac.lookup([FINE, J]), ac.retrieve_stream(FINE)):
                with pytest.raises(Corrupt):
                    await asyncio.wait_for(call, 30)

    asyncio.run(main())


def test_retries_end_by_the_calls_deadline(lying: tuple[Lying, str, str]) -> None:
    """A server that fails UNAVAILABLE after 0.6 s: the call's retries share its deadline
    (1 s from the client, 0.8 s given to the lookup), not one each."""
    servicer, address, _ = lying
    servicer.unavailable_after_s = 0.6
    with Client(address, timeout_s=1.0) as c:
        for timeout_s, bound in ((None, 1.0), (0.8, 0.8)):
            servicer.lookups = 0
            t0 = time.perf_counter()
            with pytest.raises((DeadlineExceeded, Unavailable)):
                c.lookup([FINE], timeout_s=timeout_s)
            took = time.perf_counter() - t0
            assert took < bound + 0.3, f"{took:.2f} s for a call of {bound} s"
            assert servicer.lookups <= 2


def test_an_answer_that_ended_ok_without_a_message_is_unavailable(tmp_path: Path) -> None:
    """A GetMany that ends OK with no message (what gRPC hands back where the answer's first
    bytes were damaged on the way): Unavailable, not an AttributeError from deep inside."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=OPTIONS)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("kdn.v1.KDN", {
        "GetMany": grpc.unary_stream_rpc_method_handler(lambda req, ctx: iter(()))}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", shm_bytes=0, data_path=False) as c:
            for read in (c.retrieve, c.fetch):
                with pytest.raises(Unavailable, match="answer was lost"):
                    read(FINE)
    finally:
        server.stop(0)
