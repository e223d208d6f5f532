"""Store + retrieve throughput of uncompressed KV through kdn vs raw gRPC streaming.

    python -m bench.roundtrip [--quick] --out bench/results/roundtrip.json

Both sides run in this process on 127.0.0.1 with the same gRPC options and stream the same bytes
in messages of the same size (one message per layer frame). The raw baseline is a bare gRPC
service whose Put keeps the joined bytes in a dict and whose Get streams them back: transport
only. kdn adds encoding (raw mode), header/frame checksums and shape checks, the tier put, and on
retrieve the frame split plus (for ``retrieve``) building per-layer tensors; ``fetch`` stops at
bytes, like the baseline.
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import torch

from bench.common import arg_parser, figure, median, print_table, save_figure, timed, write_json
from kdn import codec, keys
from kdn.cache import KVCache
from kdn.client import Client
from kdn.layout import KVLayout, LayerLayout
from kdn.server import ServerConfig, ServerThread

OPTS = [("grpc.max_receive_message_length", 256 << 20),
        ("grpc.max_send_message_length", 256 << 20)]


def smollm2_like_layout() -> KVLayout:
    """SmolLM2-135M's KV shape: 30 layers, 3 KV heads, 64 channels, fp16 (no weights needed)."""
    return KVLayout("smollm2-135m-shape", tuple(LayerLayout(3, 64, 64) for _ in range(30)),
                    head_dim=64)


def random_cache(layout: KVLayout, tokens: int) -> KVCache:
    g = torch.Generator().manual_seed(tokens)
    return KVCache(layout, [(torch.randn(3, tokens, 64, generator=g).half(),
                             torch.randn(3, tokens, 64, generator=g).half())
                            for _ in layout.layers])


class RawServer:
    """A bare gRPC service: Put (client stream of bytes) and Get (server stream of bytes)."""

    def __init__(self) -> None:
        self.data: dict[bytes, list[bytes]] = {}
        self.loop = asyncio.new_event_loop()
        self.port = 0
        ready = threading.Event()
        threading.Thread(target=self._run, args=(ready,), daemon=True).start()
        ready.wait()

    def _run(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)

        async def put(it: AsyncIterator[bytes], ctx: Any) -> bytes:
            msgs = [m async for m in it]
            self.data[msgs[0]] = msgs[1:]
            return b""

        async def get(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
            for m in self.data[req]:
                yield m

        async def start() -> None:
            self.server = grpc.aio.server(options=OPTS)
            handler = grpc.method_handlers_generic_handler("raw.Raw", {
                "Put": grpc.stream_unary_rpc_method_handler(put),
                "Get": grpc.unary_stream_rpc_method_handler(get),
            })
            self.server.add_generic_rpc_handlers((handler,))
            self.port = self.server.add_insecure_port("127.0.0.1:0")
            await self.server.start()

        self.loop.run_until_complete(start())
        ready.set()
        self.loop.run_forever()

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(0), self.loop).result()
        self.loop.call_soon_threadsafe(self.loop.stop)


def raw_client(port: int) -> tuple[Any, Any, grpc.Channel]:
    ch = grpc.insecure_channel(f"127.0.0.1:{port}", options=OPTS)
    return ch.stream_unary("/raw.Raw/Put"), ch.unary_stream("/raw.Raw/Get"), ch


def measure(client: Client, put: Any, get: Any, layout: KVLayout, tokens: int,
            repeat: int) -> list[dict[str, Any]]:
    """Rows for one context length: kdn store/fetch/retrieve next to raw put/get."""
    kv = random_cache(layout, tokens)
    parts = codec.encode_parts(kv, "raw")
    key = keys.chunk_key(list(range(tokens)), layout)
    msgs = [key, parts.header, *parts.frames]
    nbytes = kv.nbytes

    def raw_get() -> None:
        got = list(get(key))
        assert sum(map(len, got)) >= nbytes

    raw_put_gbs = nbytes / median(timed(lambda: put(iter(msgs)), repeat)) / 1e9
    raw_get_gbs = nbytes / median(timed(raw_get, repeat)) / 1e9
    t_put = timed(lambda: client.store(key, kv, mode="raw"), repeat)
    t_put_enc = timed(lambda: client.store(key, parts), repeat)
    t_fetch = timed(lambda: client.fetch(key), repeat)
    t_get = timed(lambda: client.retrieve(key, layout=layout), repeat)
    back = client.retrieve(key, layout=layout)
    assert back is not None and back.equal(kv)
    rows = []
    for op, ts, base in (
        ("store", t_put, raw_put_gbs),
        ("store-preencoded", t_put_enc, raw_put_gbs),
        ("fetch", t_fetch, raw_get_gbs),
        ("retrieve", t_get, raw_get_gbs),
    ):
        gbs = nbytes / median(ts) / 1e9
        rows.append({"op": op, "tokens": tokens, "mib": round(nbytes / 2**20, 1),
                     "kdn_gb_s": gbs, "raw_grpc_gb_s": base, "ratio_vs_raw": gbs / base,
                     "kdn_ms": median(ts) * 1e3})
    return rows


def run(tokens_list: list[int], repeat: int, out: Path) -> list[dict[str, Any]]:
    layout = smollm2_like_layout()
    raw = RawServer()
    put, get, ch = raw_client(raw.port)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(port=0, data_dir=Path(tmp), ram_bytes=4 << 30, disk_bytes=0,
                           max_message_bytes=256 << 20, max_entry_bytes=4 << 30)
        with ServerThread(cfg) as st, Client(st.address, max_message_bytes=256 << 20) as client:
            for tokens in tokens_list:
                rows += measure(client, put, get, layout, tokens, repeat)
    ch.close()
    raw.stop()
    print_table(rows, ["op", "tokens", "mib", "kdn_gb_s", "raw_grpc_gb_s", "ratio_vs_raw",
                       "kdn_ms"])
    write_json(out, "roundtrip", rows, repeat=repeat, layout="30 layers x 3 heads x 64 fp16",
               message="one gRPC message per layer frame on both sides")
    plot(rows, out.with_suffix(".png"))
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    ops = sorted({r["op"] for r in rows}, key=[r["op"] for r in rows].index)
    toks = sorted({r["tokens"] for r in rows})
    fig, ax = figure(8, 4)
    width = 0.8 / (len(toks) * 2)
    for j, t in enumerate(toks):
        sel = [next(r for r in rows if r["op"] == op and r["tokens"] == t) for op in ops]
        xs = [i + (2 * j) * width for i in range(len(ops))]
        ax.bar(xs, [r["kdn_gb_s"] for r in sel], width, label=f"kdn {t} tok")
        ax.bar([x + width for x in xs], [r["raw_grpc_gb_s"] for r in sel], width,
               label=f"raw gRPC {t} tok", alpha=0.5)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ops))], ops)
    ax.set_ylabel("GB/s (fp16 KV bytes)")
    ax.set_title("kdn vs raw gRPC streaming, loopback")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ns = arg_parser(__doc__, "roundtrip", "one small size, few repeats").parse_args(argv)
    run([512] if ns.quick else [512, 2048, 4096], 3 if ns.quick else 7, ns.out)


if __name__ == "__main__":
    main()

