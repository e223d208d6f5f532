"""Every data-plane path of kdn next to the limit it is compared with, measured in one run.

    python -m bench.roundtrip [--quick] --out bench/results/roundtrip.json

Uncompressed (``raw``) SmolLM2-shaped fp16 KV, RAM tier, loopback, server and client in this
process. One row per (op, path, size): ``bytes``, ``seconds`` (median), ``gb_s``, and ``limit``
+ ``ratio_to_limit`` naming the limit row it is compared with:

    memcpy       numpy copy of the same bytes between warm buffers (the same-host limit)
    raw-grpc     a bare gRPC service streaming the same frames (transport only; put/get)
    raw-grpc-unary  the same service moving the entry as ONE message each way
    raw-grpc-1mib   the same service streaming the entry's bytes cut into messages of
                 ``RAW_MESSAGE_BYTES`` (1 MiB, the message size Python gRPC moves fastest
                 here); the ``raw-grpc`` limit of a size is the best of these six figures
    h2d-pinned   pinned host -> device copy (GPU hosts only)
    grpc-1       kdn over one gRPC stream (a client on another host): limit raw-grpc
    grpc-4       the same over 4 streams of layer groups, each on its own connection
    tcp          kdn's network data path (a client on another host whose server offers one,
                 ``kdn.server.netpath``): the batch calls on a TCP connection with the bytes
                 next to their descriptors: limit raw-grpc, and ``ratio_to_raw_tcp`` against
    raw-tcp      a bare TCP service moving the entry's bytes (``recv_into`` a kept buffer)
    grpc-1-first a grpc-1 fetch of a value just stored (never read: no memoised messages)
    shm          kdn on the same host: a RAM-tier entry read before is leased from the
                 server's read arena and viewed in place (no copy; ``kdn.server.arena``),
                 read again from the lease the client kept (no call) while the server's
                 value is the same, else copied into the client's shared segment: limit
                 memcpy
    shm-first    a shm fetch of a value just stored (its first read: a same-host store
                 lives in the arena, so no copy; else copied into it, checksums checked)
    shm-read     a shm retrieve, then one value read in every 4 KiB page of its tensors:
                 limit memcpy-read (a copy, then the same reads of the copy)
    shm-copy     the same-host path with the server's arenas off (every read copied into
                 the client's segment and checked)
    inproc       kdn from the client's in-process tier: limit memcpy
    batch-shm / batch-shm-copy / batch-inline / batch-tcp   64 entries of ~1 MiB in one
                 call: limit memcpy / memcpy / raw-grpc / raw-grpc

``store`` sends a pre-encoded entry (encoded as ``Client.store`` encodes a KVCache: each frame
inside its message), ``fetch`` returns the undecoded container, ``retrieve`` returns CPU
tensors (checksums verified). The stream paths send one message per frame (frames of at
least ``kdn.codec.FRAME_TARGET_BYTES``: several layers where layers are small), and a read of an
entry past ``kdn.client.received.KEEP_MESSAGES_BYTES`` asks for its frames in pieces of
``PIECE_BYTES`` (``RetrieveRequest.piece_bytes``). The gRPC
paths of one size are timed in turns with the raw service (writes, then reads: one call of
each per round), so a slow spell of the VM lands on them and their limit alike; the same-host
paths one after another, as memcpy is. Reads repeat one stored value, as a cache's hot
entries are read (the server's Retrieve then sends memoised messages: ``grpc-1-first`` is a
read of a value just stored).
Rows over gRPC also carry ``ratio_to_same_direction``: against the raw service's best figure
for the same direction (a store against its puts, a read against its gets), where
``ratio_to_limit`` takes the best of all six.

The limits themselves (the raw services, memcpy, host-to-device copy) are ``bench.baselines``.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from bench.baselines import (
    SERVER_RAM_BYTES,
    h2d_s,
    memcpy_read_s,
    memcpy_s,
    raw_client,
    raw_service,
    raw_tcp_client,
    raw_unary,
    read_pages,
    serve_raw,
)
from bench.common import (
    arg_parser,
    figure,
    kdn_server,
    median,
    print_table,
    save_figure,
    timed,
    write_json,
)
from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.layout import KVLayout, LayerLayout
from kdn.server import ServerConfig, ServerThread
from kdn.transport.buffers import tune_allocator

STREAMS = 4
"""Streams of the ``grpc-N`` rows (layer groups read side by side, ``kdn.client.parallel``)."""
REMOTE = ("grpc", "tcp")
"""Paths of a client on another host (timed in turns with the raw services)."""
RAW_MESSAGE_BYTES = 1 << 20
"""Message size of the ``raw-grpc-1mib`` rows."""


def smollm2_like_layout() -> KVLayout:
    """SmolLM2-135M's KV shape: 30 layers, 3 KV heads, 64 channels, fp16 (no weights needed)."""
    return KVLayout("smollm2-135m-shape", tuple(LayerLayout(3, 64, 64) for _ in range(30)),
                    head_dim=64)


def random_cache(layout: KVLayout, tokens: int) -> KVCache:
    g = torch.Generator().manual_seed(tokens)
    return KVCache(layout, [(torch.randn(3, tokens, 64, generator=g).half(),
                             torch.randn(3, tokens, 64, generator=g).half())
                            for _ in layout.layers])


def _row(op: str, path: str, tokens: int, nbytes: int, ts: list[float], limit: str,
         limits: dict[tuple[str, int], float]) -> dict[str, Any]:
    sec = median(ts)
    gbs = nbytes / sec / 1e9
    base = limits.get((limit, tokens), 0.0)
    return {"op": op, "path": path, "tokens": tokens, "bytes": nbytes, "seconds": sec,
            "gb_s": gbs, "limit": limit, "ratio_to_limit": gbs / base if base else None}


def measure(clients: dict[str, Client], put: Any, get: Any, layout: KVLayout, tokens: int,
            repeat: int, unary: tuple[Any, Any], tcp: tuple[Any, Any]
            ) -> list[dict[str, Any]]:
    """Rows for one context length: limits first, then every kdn path."""
    kv = random_cache(layout, tokens)
    parts = codec.encode_parts(kv, "raw", wire=True, layers_per_frame=0)  # as Client.store
    # encodes a KVCache: frames of about FRAME_TARGET_BYTES
    key = keys.chunk_key(list(range(tokens)), layout)
    msgs = [key, parts.header, *(bytes(f) for f in parts.frames)]  # the raw service's bytes
    nbytes = parts.nbytes

    def raw_get() -> None:  # the transport alone: each message dropped once counted
        assert sum(len(m) for m in get(key)) >= kv.nbytes

    whole = key + b"".join(msgs[1:])  # the unary service's one message
    mib_key = bytes(reversed(key))  # the same bytes in 1 MiB messages, under a key of its own
    mib = [mib_key] + [whole[i:i + RAW_MESSAGE_BYTES]
                       for i in range(len(key), len(whole), RAW_MESSAGE_BYTES)]

    def raw_get_mib() -> None:
        assert sum(len(m) for m in get(mib_key)) >= kv.nbytes

    def raw_get_one() -> None:
        assert len(unary[1](key)) >= kv.nbytes

    # The gRPC paths are timed in turns with the raw service (writes, then reads); the
    # same-host paths one after another, as their memcpy limit is.
    entry = memoryview(whole)[len(key):]
    writes: list[tuple[str, str, Callable[[], object]]] = [
        ("put", "raw-grpc", lambda: put(iter(msgs))),
        ("put", "raw-grpc-unary", lambda: unary[0](whole)),
        ("put", "raw-grpc-1mib", lambda: put(iter(mib))),
        ("put", "raw-tcp", lambda: tcp[0](entry))]
    reads: list[tuple[str, str, Callable[[], object]]] = [
        ("get", "raw-grpc", raw_get), ("get", "raw-grpc-unary", raw_get_one),
        ("get", "raw-grpc-1mib", raw_get_mib), ("get", "raw-tcp", lambda: tcp[1](len(entry)))]
    local: list[tuple[str, str, Callable[[], object]]] = []
    for path, client in clients.items():
        mine = reads if path.startswith(REMOTE) else local
        if path == "inproc" or path.startswith("grpc-") and path != "grpc-1":
            # reads only: the tier is filled by the stores; grpc-N stores like grpc-1
            if path == "inproc":
                mine.append(("fetch", path, lambda c=client: c.fetch(key)))
        else:
            (writes if path.startswith(REMOTE) else local).append(
                ("store", path, lambda c=client: c.store(key, parts)))
            mine.append(("fetch", path, lambda c=client: c.fetch(key)))
        mine.append(("retrieve", path, lambda c=client: c.retrieve(key, layout=layout)))
    times = interleaved(writes, repeat)
    for op, path, fn in local:  # the stores first: the inproc client's tier is filled too
        if path == "inproc" and op == "fetch":
            clients[path].store(key, parts)
        times[(op, path)] = timed(fn, repeat)
    times.update(interleaved(reads, repeat))
    def stored_then_fetched(c: Client) -> float:  # a value never read before (no memo, no
        c.store(key, parts)  # arena copy)
        t = time.perf_counter()
        c.fetch(key)
        return time.perf_counter() - t

    for path in ("grpc-1", "shm"):
        times[("fetch", f"{path}-first")] = [stored_then_fetched(clients[path])
                                             for _ in range(repeat)]
    shm = clients["shm"]
    times[("retrieve", "shm-read")] = timed(
        lambda: read_pages(shm.retrieve(key, layout=layout)), repeat)  # type: ignore[arg-type]
    limits: dict[tuple[str, int], float] = {}
    rows = []
    for op, path, ts in (("copy", "memcpy", memcpy_s(nbytes, repeat)),
                         ("put", "raw-grpc", times.pop(("put", "raw-grpc"))),
                         ("get", "raw-grpc", times.pop(("get", "raw-grpc"))),
                         ("put", "raw-grpc-unary", times.pop(("put", "raw-grpc-unary"))),
                         ("get", "raw-grpc-unary", times.pop(("get", "raw-grpc-unary"))),
                         ("put", "raw-grpc-1mib", times.pop(("put", "raw-grpc-1mib"))),
                         ("get", "raw-grpc-1mib", times.pop(("get", "raw-grpc-1mib"))),
                         ("put", "raw-tcp", times.pop(("put", "raw-tcp"))),
                         ("get", "raw-tcp", times.pop(("get", "raw-tcp"))),
                         ("copy", "memcpy-read", memcpy_read_s(nbytes, repeat)),
                         ("copy", "h2d-pinned", h2d_s(nbytes, repeat))):
        if ts is None:
            continue
        row = _row(op, path, tokens, nbytes, ts, "", limits)
        limits[(path if op == "copy" else f"{path}-{op}", tokens)] = row["gb_s"]
        rows.append(row)
    limits[("raw-grpc", tokens)] = max(limits[(f"raw-grpc{form}-{op}", tokens)]
                                       for form in ("", "-unary", "-1mib")
                                       for op in ("put", "get"))
    for (op, path), ts in times.items():
        limit = "raw-grpc" if path.startswith(REMOTE) else \
            "memcpy-read" if path == "shm-read" else "memcpy"
        rows.append(_row(op, path, tokens, nbytes, ts, limit, limits))
        if path == "tcp":  # and the transport it runs on, the same direction
            raw = f"raw-tcp-{'put' if op == 'store' else 'get'}"
            rows[-1]["tcp_limit"] = raw
            rows[-1]["ratio_to_raw_tcp"] = rows[-1]["gb_s"] / limits[(raw, tokens)]
    for path, client in clients.items():
        back = client.retrieve(key, layout=layout)
        assert back is not None and back.equal(kv), path
    return rows


def interleaved(ops: list[tuple[str, str, Callable[[], object]]],
                repeat: int) -> dict[tuple[str, str], list[float]]:
    """Seconds of ``repeat`` calls of each op, taken in turns (one call of each per round,
    after one untimed round): a slow spell of this shared VM then lands on every path
    alike instead of on whichever was being measured."""
    for _, _, fn in ops:
        fn()
    out: dict[tuple[str, str], list[float]] = {(op, path): [] for op, path, _ in ops}
    for _ in range(repeat):
        for op, path, fn in ops:
            t = time.perf_counter()
            fn()
            out[(op, path)].append(time.perf_counter() - t)
    return out


def batch_rows(clients: dict[str, Client], layout: KVLayout, repeat: int,
               limits: dict[tuple[str, int], float], put: Any, get: Any
               ) -> list[dict[str, Any]]:
    """64 entries of ~1 MiB each, stored and fetched in one call per path. The gRPC ones are
    timed in turns with the raw service moving the same bytes in 1 MiB messages, each way
    (``raw-grpc-1mib`` rows of the batch's size: their same-direction figure)."""
    tokens = 64 * 2**20 // (layout.bytes_per_token * 64)
    items = [(keys.chunk_key([i, 1], layout), codec.encode_parts(  # as Client.store encodes
        random_cache(layout, tokens), "raw", wire=True, layers_per_frame=0)) for i in range(64)]
    nbytes = sum(p.nbytes for _, p in items)
    ks = [k for k, _ in items]
    whole = b"".join(bytes(p.header) + b"".join(bytes(f) for f in p.frames) for _, p in items)
    mib_key = b"batch of 64 entries".ljust(32, b".")
    mib = [mib_key] + [whole[i:i + RAW_MESSAGE_BYTES] for i in range(0, len(whole),
                                                                      RAW_MESSAGE_BYTES)]

    def raw_get() -> None:
        assert sum(len(m) for m in get(mib_key)) == len(whole)

    rows = []
    for path, client in (("batch-shm", clients["shm"]), ("batch-shm-copy", clients["shm-copy"])):
        rows.append(_row("store", path, tokens * 64, nbytes,
                         timed(lambda c=client: c.store_many(items), repeat), "memcpy", limits))
        rows.append(_row("fetch", path, tokens * 64, nbytes,
                         timed(lambda c=client: c.fetch_many(ks), repeat), "memcpy", limits))
    remote, loop, tcp = clients["grpc-1"], clients["grpc-1"], clients["tcp"]
    times = interleaved([
        ("put", "raw-grpc-1mib", lambda: put(iter(mib))),
        ("store", "batch-inline", lambda: remote.store_many(items)),
        ("store", "batch-tcp", lambda: tcp.store_many(items)),
        ("get", "raw-grpc-1mib", raw_get),
        ("fetch", "batch-inline", lambda: remote.fetch_many(ks)),
        ("fetch", "batch-tcp", lambda: tcp.fetch_many(ks)),
        ("fetch", "loop-grpc-1", lambda: [loop.fetch(k) for k in ks])], repeat)
    for (op, path), ts in times.items():
        rows.append(_row(op, path, tokens * 64, nbytes, ts,
                         "" if path.startswith("raw") else "raw-grpc", limits))
    return rows


@contextmanager
def kdn_services(tmp: Path, where: str, big: int) -> Iterator[tuple[str, str]]:
    """Addresses of two kdn servers, RAM tier only: one as configured by default, one with
    the read arenas off (``shm-copy``); ``kdn serve`` processes, or ``ServerThread``s of
    this process (``thread``)."""
    if where == "thread":
        cfg = ServerConfig(port=0, data_dir=tmp, ram_bytes=SERVER_RAM_BYTES, disk_bytes=0,
                           max_message_bytes=big, max_entry_bytes=4 << 30)
        copy_cfg = dataclasses.replace(cfg, port=0, data_dir=tmp / "copy", shm_arena_bytes=0)
        with ServerThread(cfg) as st, ServerThread(copy_cfg) as copy_st:
            yield st.address, copy_st.address
        return
    flags = ("--ram-bytes", str(SERVER_RAM_BYTES), "--max-message-bytes", str(big),
             "--max-entry-bytes", str(4 << 30))
    with kdn_server(tmp / "kdn", *flags) as address, \
            kdn_server(tmp / "kdn-copy", *flags, "--shm-arena-bytes", "0") as copy_address:
        yield address, copy_address


def run(tokens_list: list[int], repeat: int, out: Path, server: str = "process"
        ) -> list[dict[str, Any]]:
    """Every row; ``server``: where the servers run (``process``: kdn and the raw service
    each in a process of their own, as a remote client meets them; ``thread``: in this one,
    sharing its interpreter with the client)."""
    tune_allocator()  # what kdn's Client sets, before the baselines: they run with it too
    layout = smollm2_like_layout()
    rows: list[dict[str, Any]] = []
    big = 512 << 20
    with tempfile.TemporaryDirectory() as tmp, raw_service(server) as (raw_port, tcp_port), \
            kdn_services(Path(tmp), server, big) as (address, copy_address):
        put, get, ch = raw_client(raw_port)
        tcp_put, tcp_get, tcp_conn = raw_tcp_client(tcp_port)
        clients = {  # a remote client's paths: gRPC (data_path off) and the data path (tcp)
            "grpc-1": Client(address, max_message_bytes=big, shm_bytes=0, data_path=False),
            f"grpc-{STREAMS}": Client(address, max_message_bytes=big, shm_bytes=0,
                                      streams=STREAMS, data_path=False),
            "tcp": Client(address, max_message_bytes=big, shm_bytes=0),
            "shm": Client(address, max_message_bytes=big, shm_bytes=1 << 30),
            "shm-copy": Client(copy_address, max_message_bytes=big, shm_bytes=1 << 30),
            "inproc": Client(address, max_message_bytes=big, shm_bytes=0,
                             local_bytes=2 << 30, data_path=False),
        }
        for tokens in tokens_list:
            rows += measure(clients, put, get, layout, tokens, repeat, raw_unary(ch),
                            (tcp_put, tcp_get))
        limits = {(r["path"], r["tokens"]): r["gb_s"] for r in rows if r["op"] == "copy"}
        limits.update({("raw-grpc", r["tokens"]): max(
            x["gb_s"] for x in rows
            if x["path"].startswith("raw-grpc") and x["tokens"] == r["tokens"])
            for r in rows if r["path"] == "raw-grpc"})
        batch = batch_rows(clients, layout, repeat, {}, put, get)
        n = batch[0]["tokens"]
        memcpy = memcpy_s(batch[0]["bytes"], repeat)
        limits[("memcpy", n)] = batch[0]["bytes"] / median(memcpy) / 1e9
        limits[("raw-grpc", n)] = max([v for (p, _), v in limits.items() if p == "raw-grpc"]
                                      + [r["gb_s"] for r in batch
                                         if r["path"].startswith("raw-grpc")])
        for r in batch:  # the best raw figure of any size, the batch's own included
            base = limits.get((r["limit"], n))
            r["ratio_to_limit"] = r["gb_s"] / base if base else None
        rows += batch
        _same_direction(rows)
        for c in clients.values():
            c.close()
        ch.close()
        tcp_conn.close()
    print_table(rows, ["op", "path", "tokens", "bytes", "gb_s", "limit", "ratio_to_limit",
                       "ratio_to_same_direction", "ratio_to_raw_tcp"])
    write_json(out, "roundtrip", rows, repeat=repeat, layout="30 layers x 3 heads x 64 fp16",
               message="one gRPC message per frame (~1 MiB or one layer) on the stream "
               "paths; reads past 64 MiB in 1 MiB pieces",
               server=("kdn serve and the raw service each in a process of their own"
                       if server == "process" else "in this process (ServerThread)")
               + ", RAM tier only")
    plot(rows, out.with_suffix(".png"))
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    sel = [r for r in rows if r["op"] in ("fetch", "retrieve", "store") and
           not r["path"].startswith(("batch", "loop"))]
    toks = sorted({r["tokens"] for r in sel})
    series = sorted({(r["op"], r["path"]) for r in sel})
    fig, ax = figure(9, 4.5)
    width = 0.8 / len(series)
    for j, (op, p) in enumerate(series):
        ys = [next((r["gb_s"] for r in sel if r["tokens"] == t and r["op"] == op
                    and r["path"] == p), 0) for t in toks]
        ax.bar([i + j * width for i in range(len(toks))], ys, width, label=f"{op} {p}")
    for lim, style in (("memcpy", "--"), ("raw-grpc", ":")):
        ys = [max((r["gb_s"] for r in rows if r["path"] == lim and r["tokens"] == t),
                  default=0) for t in toks]
        ax.plot([i + 0.4 for i in range(len(toks))], ys, style, color="k", label=lim)
    ax.set_xticks([i + 0.4 for i in range(len(toks))], [f"{t} tok" for t in toks])
    ax.set_ylabel("GB/s")
    ax.set_yscale("log")
    ax.set_title("kdn data-plane paths vs memcpy and raw gRPC (loopback, RAM tier)")
    ax.legend(fontsize=6, ncol=3)
    save_figure(fig, path)


def _same_direction(rows: list[dict[str, Any]]) -> None:
    """Each gRPC row's ratio to the raw service in its own direction, at its own size (the
    batch rows: the raw service moving the batch's bytes)."""
    raw: dict[tuple[str, int], float] = {}
    for r in rows:  # the better of the raw stream and the raw unary call, per direction
        if r["path"].startswith("raw-grpc"):
            raw[r["op"], r["tokens"]] = max(raw.get((r["op"], r["tokens"]), 0.0), r["gb_s"])
    for r in rows:
        if r["limit"] != "raw-grpc":
            continue
        op = "put" if r["op"] == "store" else "get"
        base = raw.get((op, r["tokens"])) or max(v for (o, _), v in raw.items() if o == op)
        r["same_direction_limit"] = f"raw-grpc-{op}"
        r["ratio_to_same_direction"] = r["gb_s"] / base


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "roundtrip", "one small size, few repeats")
    ap.add_argument("--server", choices=("process", "thread"), default="process",
                    help="where kdn's servers and the raw service run: processes of their own "
                    "(as a remote client meets them), or threads of this process")
    ap.add_argument("--raw-server", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.raw_server:
        serve_raw()
        return
    run([512, 2048] if ns.quick else [512, 2048, 8192], 3 if ns.quick else 7, ns.out,
        ns.server)


if __name__ == "__main__":
    main()
