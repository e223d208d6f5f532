"""atheris fuzz target: the server's Store-stream validation, header and frames as the servicer
sees them.

    python fuzz/fuzz_store.py -runs=20000           # or -max_total_time=600

No network: each input drives ``KDNServicer.Store`` (the handler gRPC calls, its
``kdn.server.rpc.rpc`` status mapping included) on one event loop, with a RAM-tier ``TieredStore``
as the server builds it, a tenant with a quota, an ``allowed_models`` list and a small
``max_entry_bytes``. The request messages go through the server's deserializer
(``kdn.transport.wire.store_request`` wrapped by the request interceptor's
``kdn.server.requests.checked``: malformed messages and names end the call with INVALID_ARGUMENT),
so the servicer gets what it gets from gRPC: hand-encoded frame messages as zero-copy views,
anything else as generated messages.

An input is a container of ``fuzz/reseal_seeds.py`` (every mode and level, pruned and other
layouts, version 1 and 2), mutated and resealed or left as it is, sent as a stream that may
be mutated too: namespace, key, the header's ``layout_fingerprint``, ``total_bytes`` and
options (durability values outside the enum included), trailing bytes after the container
header, frames dropped, repeated, swapped, re-indexed or encoded by the generated class, a
second header, an empty message, garbage bytes, frames of another entry of the same layout.

Oracles: the handler ends with a status (an abort) or a response, never another exception; a
refusal is INVALID_ARGUMENT, RESOURCE_EXHAUSTED or FAILED_PRECONDITION (client input is never
INTERNAL or DATA_LOSS) and changes nothing: the slot keeps its previous value (an entry is
always there to be overwritten), no other key appears, the tenant's usage is unchanged. An
accepted stream is exactly what was sent, passes the stored-entry check, is charged exactly,
comes back from Retrieve byte for byte, and decodes (or is refused by a mode decoder with a
kdn error: the server checks structure, not bodies) to the shapes its header declares; an
unmutated stream of a seed decodes to the seed's tensors.

Measured 2026-11-23 (atheris 3.0, Python 3.11, one process on a 2-core machine shared with
other engineers' jobs, load average 0.7-1.3, so absolute rates are low):

- 10-minute run (``-max_total_time=600 -seed=11``, empty corpus, after the container run, not
  beside it): 476,034 inputs, 792/s on average (~1,000/s in the first seconds), 641 coverage
  edges (2,485 features), 333 corpus entries, peak RSS 1.1 GB; found nothing.
- The suite's run (``-runs=6000 -seed=1``) takes ~10 s, start-up included.
- Found while building it (fixed in ``kdn.server.ingest.Ingest.check_header``, with a test in
  tests/test_hostile.py), within its first seconds: a durability outside the enum raised
  ValueError in ``_commit`` after the tenant was charged (UNKNOWN; on PutMany after earlier
  items were stored), and a durability the server has no tier for failed in the put, also
  after the charge, so refused stores leaked quota. Both are refused with the header now.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import atheris

# not instrumented: coverage is wanted in kdn's own code (and numba compiles kdn.codec.rans)
import grpc
import numpy  # noqa: F401
import torch  # noqa: F401
import zstandard  # noqa: F401

with atheris.instrument_imports(include=["kdn"], exclude=["kdn.codec.rans", "kdn.codec.gpu"]):
    from kdn import codec
    from kdn.codec import format as fmt
    from kdn.errors import KDNError
    from kdn.keys import store_key
    from kdn.server.app import build_store
    from kdn.server.auth import (
        AuthConfig,
        Authenticator,
        Principal,
        Role,
        TenantPolicy,
        current_principal,
    )
    from kdn.server.config import ServerConfig
    from kdn.server.requests import BadRequest, checked
    from kdn.server.service import KDNServicer
    from kdn.transport.wire import frame_message, retrieve_response, store_request
    from kdn.v1 import kdn_pb2 as pb

    codec.mode_names()  # the mode modules load on first use: here, instrumented

import reseal  # noqa: E402  (after kdn is imported instrumented)
import reseal_bytes  # noqa: E402  (after kdn is imported instrumented)
import reseal_seeds  # noqa: E402  (after kdn is imported instrumented)

SEEDS = reseal_seeds.build_seeds()
TENANT = "fuzz"
QUOTA = 48 << 10
KEY = bytes(range(32))
REFUSED = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}
_DATA = Path(tempfile.mkdtemp(prefix="kdn-fuzz-store-"))
CONFIG = ServerConfig(port=0, data_dir=_DATA, disk_bytes=0, ram_bytes=64 << 20,
                      max_entry_bytes=12 << 10,  # the 1100-token lossless seeds are too large
                      allowed_models=tuple(sorted({s.ref.layout.model_fingerprint
                                                   for s in SEEDS})))
STORE = build_store(CONFIG)
AUTH = Authenticator(AuthConfig(policies={TENANT: TenantPolicy(quota_bytes=QUOTA)}))
SERVICER = KDNServicer(CONFIG, STORE, AUTH)
LOOP = asyncio.new_event_loop()
current_principal.set(Principal(TENANT, Role.TENANT))  # tasks and worker threads copy it
SLOT = store_key(TENANT, "default", KEY)
BASE = SEEDS[0].blob  # what the slot holds before every input


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


class Context:
    """The part of ``grpc.aio.ServicerContext`` the handlers use: an abort (a bad request
    message), or a status set before the handler returns (``kdn.server.rpc.end_call``)."""

    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.details = ""

    async def abort(self, code: grpc.StatusCode, details: str = "") -> None:
        raise Aborted(code, details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details

    def ended(self) -> None:
        """The call's end: Aborted where the handler set a status."""
        if self.code is not None:
            raise Aborted(self.code, self.details)


def _reset() -> None:
    for k in STORE.keys(b""):
        if k != SLOT:
            STORE.delete(k)
    STORE.put(SLOT, BASE)
    AUTH.set_usage(TENANT, len(BASE))


def _snapshot() -> dict[bytes, bytes]:
    out = {}
    for k in STORE.keys(b""):
        hit = STORE.get(k)
        if hit is not None:
            out[k] = bytes(hit.value)
    return out


def _header_msg(fdp: atheris.FuzzedDataProvider, header: bytes, value_len: int
                ) -> tuple[pb.StoreHeader, str, bytes]:
    ns = "default"  # mostly the slot, which holds an entry before every input
    if fdp.ConsumeIntInRange(0, 3) == 1:
        ns = fdp.PickValueInList(["", "ns-2", "a/b", "default\n", "x" * 200,
                                  reseal_bytes.some_text(fdp, ["", "ns"])])
    key = KEY
    if fdp.ConsumeIntInRange(0, 7) == 1:
        key = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 40))
    if fdp.ConsumeIntInRange(0, 7) == 1:
        header = header + fdp.ConsumeBytes(fdp.ConsumeIntInRange(1, 8))
    msg = pb.StoreHeader(namespace=ns, key=key, container_header=header)
    how = fdp.ConsumeIntInRange(0, 3)
    if how == 1:
        with contextlib.suppress(KDNError):
            msg.layout_fingerprint = fmt.parse_header(header).layout.fingerprint
    elif how == 2:
        msg.layout_fingerprint = reseal_bytes.some_text(fdp, ["0" * 32, "x"])
    how = fdp.ConsumeIntInRange(0, 3)
    if how == 1:
        msg.total_bytes = value_len
    elif how == 2:
        msg.total_bytes = reseal_bytes.some_int(fdp, 64, value_len)
    if fdp.ConsumeIntInRange(0, 7) == 1:
        msg.options.durability = reseal_bytes.some_int(fdp, 31, 0) if fdp.ConsumeBool() \
            else fdp.ConsumeIntInRange(0, 3)  # type: ignore[assignment]
        msg.options.ttl_seconds = reseal_bytes.some_int(fdp, 64) if fdp.ConsumeBool() else 0
        msg.options.pin = fdp.ConsumeBool()
    return msg, ns, key


def _stream(fdp: atheris.FuzzedDataProvider, hdr: pb.StoreHeader, frames: list[bytes],
            partner: reseal_seeds.Seed | None) -> tuple[list[bytes], bytes]:
    """The serialized request messages (a header, then the frames, perhaps mutated) and the
    value they carry."""
    msgs = [pb.StoreRequest(header=hdr).SerializeToString()]
    body = [(i, f) for i, f in enumerate(frames)]
    for _ in range(fdp.ConsumeIntInRange(0, 2)):
        how = fdp.ConsumeIntInRange(0, 6)
        i = reseal_bytes.some_index(fdp, len(body))
        if how == 0 and body:
            del body[i]
        elif how == 1 and body:
            body.insert(i, body[i])
        elif how == 2 and len(body) > 1:
            j = reseal_bytes.some_index(fdp, len(body))
            body[i], body[j] = body[j], body[i]
        elif how == 3 and body:
            body[i] = (reseal_bytes.some_int(fdp, 32, body[i][0]), body[i][1])
        elif how == 4 and partner is not None and i < len(partner.frames) and body:
            body[i] = (body[i][0], partner.frames[i])  # another entry's frame, its own sum
        elif how == 5 and body:
            body[i] = (body[i][0], body[i][1][: reseal_bytes.some_index(fdp, len(body[i][1]) + 1)])
    out = []
    for i, f in body:
        if fdp.ConsumeIntInRange(0, 7) == 0:  # another valid encoding: the generated class
            out.append(pb.StoreRequest(frame=pb.Frame(index=i, data=f)).SerializeToString())
        else:
            out.append(frame_message(i, f))
    value = b"".join([hdr.container_header, *(f for _, f in body)])
    extra = fdp.ConsumeIntInRange(0, 15)
    if extra == 1:
        out.insert(reseal_bytes.some_index(fdp, len(out) + 1), msgs[0])  # a second header
    elif extra == 2:
        out.insert(reseal_bytes.some_index(fdp, len(out) + 1), b"")  # a message with no part
    elif extra == 3:
        out.insert(reseal_bytes.some_index(fdp, len(out) + 1), fdp.ConsumeBytes(32))  # garbage
    elif extra == 4:
        return out, value  # no header first
    return msgs + out, value


_PARSE = checked(store_request, "Store")  # the deserializer the request interceptor installs


async def _requests(msgs: list[bytes], context: Context) -> AsyncIterator[Any]:
    """The request stream as the handler gets it (``kdn.server.observe._checked_stream``)."""
    for m in msgs:
        request = _PARSE(m)
        if isinstance(request, BadRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


async def _retrieve(ns: str, key: bytes) -> bytes:
    parts: list[bytes] = []
    ctx = Context()
    async for msg in SERVICER.Retrieve(pb.RetrieveRequest(namespace=ns, key=key), ctx):
        m = retrieve_response(msg) if isinstance(msg, bytes) else msg
        parts.append(bytes(m.header.container_header) if m.WhichOneof("part") == "header"
                     else bytes(m.frame.data))
    ctx.ended()
    return b"".join(parts)


def _check_stored(seed: reseal_seeds.Seed, ns: str, key: bytes, sent: bytes,
                  resp: pb.StoreResponse, before: dict[bytes, bytes], usage: int) -> None:
    skey = store_key(TENANT, ns or "default", key)
    hit = STORE.get(skey)
    if hit is None or bytes(hit.value) != sent:
        raise AssertionError("an accepted Store is not what was sent")
    if resp.stored_bytes != len(sent) or resp.replaced != (skey in before):
        raise AssertionError(f"StoreResponse {resp} for {len(sent)} bytes")
    if AUTH.usage(TENANT) != usage - len(before.get(skey, b"")) + len(sent):
        raise AssertionError(f"usage {AUTH.usage(TENANT)} after storing {len(sent)} bytes "
                             f"over {len(before.get(skey, b''))} (was {usage})")
    if set(_snapshot()) != set(before) | {skey}:
        raise AssertionError("an accepted Store changed other keys")
    fmt.parse_container(sent, verify=True)
    if LOOP.run_until_complete(_retrieve(ns, key)) != sent:
        raise AssertionError("Retrieve gives back other bytes than were stored")
    try:
        out = codec.decode(sent)
    except KDNError:
        if sent == seed.blob:
            raise AssertionError(f"seed {seed.name} stored but does not decode") from None
        return  # a resealed body the server took (it checks shapes, not bodies)
    shapes = reseal_seeds.declared_shapes(fmt.parse_header(sent).entry)[1]
    if [(tuple(k.shape), tuple(v.shape)) for k, v in out.layers] != shapes:
        raise AssertionError("a stored entry decodes to shapes its header does not declare")
    if sent == seed.blob and not reseal_seeds.same_tensors(out, seed.ref):
        raise AssertionError(f"seed {seed.name} stored and decoded to other tensors")


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    seed = SEEDS[fdp.ConsumeIntInRange(0, len(SEEDS) - 1)]
    partner = SEEDS[seed.partner] if seed.partner >= 0 else None
    header, frames = seed.blob[: fmt.header_size(seed.blob)], list(seed.frames)
    if fdp.ConsumeIntInRange(0, 3):  # mostly: mutated and resealed
        case = reseal.Case(seed)
        case.mutate(fdp, partner)
        try:
            header, frames = case.seal()
        except KDNError:
            return
    hdr, ns, key = _header_msg(fdp, header, len(header) + sum(map(len, frames)))
    msgs, sent = _stream(fdp, hdr, frames, partner)
    _reset()
    before, usage = _snapshot(), AUTH.usage(TENANT)
    try:
        ctx = Context()
        resp = LOOP.run_until_complete(SERVICER.Store(_requests(msgs, ctx), ctx))
        ctx.ended()
    except Aborted as exc:
        if exc.code not in REFUSED:
            raise AssertionError(f"client input answered {exc}") from None
        if _snapshot() != before or AUTH.usage(TENANT) != usage:
            raise AssertionError(f"a refused Store ({exc}) changed what is stored or the "
                                 "usage") from None
        return
    _check_stored(seed, ns, key, sent, resp, before, usage)


def main() -> None:
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
