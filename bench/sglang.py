"""kdn as SGLang's L3 (HiCache) storage next to SGLang's own ``HiCacheFile``, one run.

    python -m bench.sglang [--quick] --out bench/results/sglang.json

Needs the ``sglang`` extra (``scripts/bootstrap.sh sglang``). Both backends are made by SGLang's
``StorageBackendFactory`` (kdn through its ``dynamic`` path) and move the same pages between
a host KV pool and storage: SmolLM2-135M-shaped fp16 pages (30 layers x 3 KV heads x 64
channels, 64 tokens: 1.47 MB a page), random values, 128 pages a call (SGLang's
``STORAGE_BATCH_SIZE``). Rows (``op``):

    get        the headline: a first read, as HiCache makes it (pages set once, on eviction
               from GPU or host memory, and read once, on a later prefix hit). The batches
               of distinct keys the ``set`` row wrote (5; 2 with ``--quick``) are read once
               each, in the order written, from ``SETTLE_S`` after the last write (for
               both backends: what a write leaves running, kdn's server faulting memory in
               ahead of its next stores or the kernel writing HiCacheFile's files back, is
               the write's, not the read's); the timer is around each read alone. kdn
               ``batch_get_v1`` of the pages into the host pool by index, against
               HiCacheFile's read of the same pages into the same pool (its ``batch_get_v2``
               of the KV pool: the per-page read + copy SGLang does for it)
    get_again  the best case: one batch read again and again (one warm-up read, then
               three times as many timed reads of the same 128 keys). kdn's client keeps the
               leases of entries it read (``kdn.client.shm``) and reads them again without
               a call; HiCacheFile's files are as warm as after their first read
    set        ``batch_set_v1`` against HiCacheFile's write of the same pages (new keys each
               time: both backends skip pages they hold)

Columns: ``seconds`` (median wall time of the row's timed calls), ``gb_s`` (page bytes, fp16,
moved per second), ``ratio_vs_file`` (kdn ``gb_s`` / HiCacheFile's of the same op, this run),
``cpu_s`` (median CPU seconds of a call, every thread of this process: kdn's client and
server, or HiCacheFile and the kernel's work in its calls; steadier than wall time on a
shared host), ``stored_vs_fp16`` (the bytes kdn holds per page over the page's fp16 bytes),
``bit_identical`` (every page read back, by both reads, equals the page written),
``max_abs_err``, ``pages`` (per call), ``page_bytes``. kdn rows per codec mode: ``raw`` (the
backend's default), ``lossless`` and ``int8``. The kdn server runs in this process
(``ServerThread``), RAM tier only, the client on its shared segment; HiCacheFile writes to a
temporary folder and reads it back from the page cache (warm, like kdn's RAM tier). A same-host
store is kept in the tenant's read arena while the arena's half for stores has room (256 MiB of
the default 512 MiB: ``kdn.server.arena``), and such a page's first read copies nothing; the
modes share one server, and the batches written first (the ``get_again`` rows' batch) fill that
half: none of the batches the ``get`` rows read is there, as most pages of a running engine are
not. The backends take turns call by call (``measure``), each reading into a page range of its
own.

``HostPool`` is the smallest real tensor pool with the page layouts of SGLang's
``MHATokenToKVPoolHost`` (its module can not be imported on a CPU-only host: SGLang's config
package imports torchvision, whose PyPI wheel needs CUDA torch): the same ``kv_buffer`` shapes
and the same ``get_data_page``/``get_dummy_flat_data_page``/``set_from_flat_data_page``
contract, which is all either backend touches. The tests use it too.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from bench.common import arg_parser, figure, median, print_table, save_figure, write_json
from kdn.server import ServerConfig, ServerThread

LAYERS, HEADS, HEAD_DIM, PAGE = 30, 3, 64, 64
BATCH = 128
MODES = ("lossless", "raw", "int8")
OPS = ("get", "get_again", "set")
SETTLE_S = 3.0
"""Seconds between a backend's last write and its first read (module docstring)."""


class HostPool:
    """A host KV pool with SGLang's MHA page layouts (``MHATokenToKVPoolHost``'s contract).

    ``kv_buffer``:  layer_first        [2, layers, size, heads, head_dim]
                    page_first         [2, size, layers, heads, head_dim]
                    page_first_direct  [2, pages, layers, page_size, heads, head_dim]
    A flat data page lists the page's elements in the buffer's own order."""

    def __init__(self, layout: str, pages: int, *, layers: int = LAYERS, heads: int = HEADS,
                 head_dim: int = HEAD_DIM, page_size: int = PAGE,
                 dtype: torch.dtype = torch.float16, seed: int | None = None) -> None:
        self.layout = layout
        self.layer_num, self.head_num, self.head_dim, self.v_head_dim = (
            layers, heads, head_dim, head_dim)
        self.page_size, self.page_num, self.size = page_size, pages, pages * page_size
        self.dtype, self.device = dtype, "cpu"
        dims = {"layer_first": (2, layers, self.size, heads, head_dim),
                "page_first": (2, self.size, layers, heads, head_dim),
                "page_first_direct": (2, pages, layers, page_size, heads, head_dim)}[layout]
        if seed is None:
            self.kv_buffer = torch.zeros(dims, dtype=dtype)
        else:
            g = torch.Generator().manual_seed(seed)
            self.kv_buffer = torch.randn(dims, generator=g).to(dtype)

    def _page(self, index: int) -> torch.Tensor:
        if self.layout == "layer_first":
            return self.kv_buffer[:, :, index : index + self.page_size]
        if self.layout == "page_first":
            return self.kv_buffer[:, index : index + self.page_size]
        return self.kv_buffer[:, index // self.page_size : index // self.page_size + 1]

    def get_data_page(self, index: int, flat: bool = True) -> torch.Tensor:
        page = self._page(index)
        return page.flatten() if flat else page

    def get_dummy_flat_data_page(self) -> torch.Tensor:
        return torch.zeros(2 * self.layer_num * self.page_size * self.head_num * self.head_dim,
                           dtype=self.dtype)

    def set_from_flat_data_page(self, index: int, data_page: torch.Tensor) -> None:
        dst = self._page(index)
        dst.copy_(data_page.reshape(dst.shape))

    def indices(self, pages: range | list[int]) -> torch.Tensor:
        """Token slots of ``pages`` (page j: slots j*P .. j*P+P-1), as SGLang hands them."""
        p = self.page_size
        return torch.cat([torch.arange(j * p, (j + 1) * p) for j in pages]).to(torch.int64)

    def kv_of(self, page: int) -> torch.Tensor:
        """Page ``page``'s K and V in one layout-independent order: [2, layers, tokens, heads,
        head_dim] (a copy)."""
        x = self._page(page * self.page_size)
        if self.layout == "page_first":
            return x.transpose(1, 2).contiguous()
        return x.reshape(2, self.layer_num, self.page_size, self.head_num,
                         self.head_dim).clone()


def storage_config(model: str = "HuggingFaceTB/SmolLM2-135M", *, tp: tuple[int, int] = (0, 1),
                   pp: tuple[int, int] = (0, 1), page_first: bool = False,
                   extra: dict[str, Any] | None = None) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=page_first, model_name=model, extra_config=extra)


def kdn_extra(address: str, **kdn: Any) -> dict[str, Any]:
    """``--hicache-storage-backend-extra-config`` of the kdn backend."""
    return {"backend_name": "kdn", "module_path": "kdn.integrations.sglang",
            "class_name": "KDNHiCacheStorage", "interface_v1": 1,
            "kdn": {"address": address, **kdn}}


def _registered(backend: Any, pool: HostPool) -> Any:
    """``backend`` with ``pool`` registered the way SGLang's cache controller does it."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    backend.register_mem_pool_host(pool)
    backend.register_mem_host_pool_v2(pool, PoolName.KV)
    return backend


def file_backend(pool: HostPool, folder: Path, **config: Any) -> Any:
    """SGLang's ``HiCacheFile`` in ``folder``, from its factory, ``pool`` registered."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = storage_config(page_first=pool.layout != "layer_first",
                         extra={"file_storage_path": str(folder)}, **config)
    return _registered(StorageBackendFactory.create_backend("file", cfg, pool), pool)


def kdn_backend(pool: HostPool, address: str, config: dict[str, Any] | None = None,
                **kdn: Any) -> Any:
    """The kdn backend through SGLang's factory's ``dynamic`` path, ``pool`` registered;
    ``kdn`` is the extra-config's ``"kdn"`` object, ``config`` more ``storage_config``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = storage_config(page_first=pool.layout != "layer_first",
                         extra=kdn_extra(address, **kdn), **(config or {}))
    return _registered(StorageBackendFactory.create_backend("dynamic", cfg, pool), pool)


def file_transfer(keys: list[str], host_indices: torch.Tensor) -> list[Any]:
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    return [PoolTransfer(name=PoolName.KV, host_indices=host_indices, keys=keys)]


def measure(pages: int, repeat: int, tmp: Path, address: str) -> list[dict[str, Any]]:
    """Every row. The backends take turns call by call (each batch is written, then read, by
    one backend after the other), so that a change in the shared host's load meets them all
    alike; each reads into a page range of its own."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    names = ["file", *(f"kdn-{mode}" for mode in MODES)]
    pool = HostPool("layer_first", pages * (1 + len(names)), seed=0)
    src = pool.indices(range(pages))
    dsts = {name: range(pages * (1 + i), pages * (2 + i)) for i, name in enumerate(names)}
    page_bytes = 2 * LAYERS * PAGE * HEADS * HEAD_DIM * 2
    nbytes = pages * page_bytes
    want = torch.stack([pool.kv_of(j) for j in range(pages)])
    keys = [f"{j:064x}" for j in range(pages)]
    fresh = [[f"{n:04x}{k[4:]}" for k in keys] for n in range(1, repeat + 1)]  # new keys
    # each call: both backends skip pages they hold
    backends: dict[str, Any] = {"file": file_backend(pool, tmp / "file")}
    for mode in MODES:
        backends[f"kdn-{mode}"] = kdn_backend(pool, address, mode=mode,
                                              namespace=f"bench-{mode}")
    calls: dict[str, tuple[Callable[[list[str]], None], Callable[[list[str]], None]]] = {}
    for name, b in backends.items():
        dst = pool.indices(dsts[name])
        if name == "file":
            def put(ks: list[str], b: Any = b) -> None:
                assert_all(list(b.batch_set_v2(file_transfer(ks, src))[PoolName.KV]))

            def get(ks: list[str], b: Any = b, dst: torch.Tensor = dst) -> None:
                assert_all(list(b.batch_get_v2(file_transfer(ks, dst))[PoolName.KV]))
        else:
            def put(ks: list[str], b: Any = b) -> None:
                assert_all(b.batch_set_v1(ks, src))

            def get(ks: list[str], b: Any = b, dst: torch.Tensor = dst) -> None:
                assert_all(b.batch_get_v1(ks, dst))
        calls[name] = (put, get)
        put(keys)
    times: dict[tuple[str, str], tuple[list[float], list[float]]] = {
        (op, name): ([], []) for op in OPS for name in names}

    def turns(op: str, batches: list[list[str]], which: int) -> None:
        for ks in batches:
            for name in names:
                wall, cpu = timed(partial(calls[name][which], ks), 1)
                times[op, name][0].extend(wall)
                times[op, name][1].extend(cpu)

    def clear() -> None:
        for name in names:
            for j in dsts[name]:
                pool.set_from_flat_data_page(j * PAGE, pool.get_dummy_flat_data_page())

    checks: dict[str, list[tuple[bool, float]]] = {name: [] for name in names}

    def check() -> None:
        """Each backend's pages read last against the pages written."""
        for name in names:
            got = torch.stack([pool.kv_of(j) for j in dsts[name]])
            checks[name].append((torch.equal(got.view(torch.int16), want.view(torch.int16)),
                                 float((got.float() - want.float()).abs().max())))

    turns("set", fresh, 0)
    clear()
    time.sleep(SETTLE_S)
    turns("get", fresh, 1)  # each batch written once, read once
    check()
    clear()
    for name in names:  # the same batch again: one warm-up read, then short reads, 3x
        calls[name][1](keys)  # as many
    turns("get_again", [keys] * (3 * repeat), 1)
    check()
    rows: list[dict[str, Any]] = []
    for name in names:
        b = backends[name]
        row: dict[str, Any] = {"backend": name, "pages": pages, "page_bytes": page_bytes}
        if name != "file":
            stored = b.stats().stored_bytes / b.stats().pages_written
            row["stored_vs_fp16"] = stored / page_bytes
            row["max_abs_err"] = max(err for _, err in checks[name])
        row["bit_identical"] = all(ok for ok, _ in checks[name])
        for op in OPS:
            wall, cpu = times[op, name]
            rows.append({**row, "op": op, "seconds": median(wall),
                         "gb_s": nbytes / median(wall) / 1e9, "cpu_s": median(cpu)})
        if hasattr(b, "close"):
            b.close()
    base = {r["op"]: r["gb_s"] for r in rows if r["backend"] == "file"}
    for r in rows:
        r["ratio_vs_file"] = r["gb_s"] / base[r["op"]]
    order = {op: i for i, op in enumerate(OPS)}
    rows.sort(key=lambda r: (order[r["op"]], r["backend"] != "file"))
    return rows


def timed(fn: Callable[[], object], repeat: int, warmup: int = 0
          ) -> tuple[list[float], list[float]]:
    """Wall seconds and CPU seconds (every thread of this process, the kdn server's too) of
    ``repeat`` calls of ``fn`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t, c = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return wall, cpu


def assert_all(done: list[bool]) -> None:
    """Every page of a call done (a benchmark of failed calls measures nothing)."""
    if not all(done):
        raise RuntimeError(f"{done.count(False)} of {len(done)} pages failed")


def run(pages: int, repeat: int, out: Path, threads: int = 1) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(port=0, data_dir=Path(tmp) / "kdn", ram_bytes=6 << 30, disk_bytes=0)
        with ServerThread(cfg) as st:
            rows = measure(pages, repeat, Path(tmp), st.address)
    cols = ["op", "backend", "pages", "seconds", "gb_s", "ratio_vs_file", "cpu_s", "stored_vs_fp16",
            "bit_identical", "max_abs_err"]
    rows = [{**{c: r[c] for c in cols if c in r}, **r} for r in rows]  # table order
    print_table(rows, cols)
    import sglang

    write_json(out, "sglang", rows, repeat=repeat, sglang=sglang.__version__,
               torch_threads=threads,
               page="30 layers x 3 heads x 64 fp16, 64 tokens",
               pool="layer_first host pool (bench.sglang.HostPool)",
               server="in this process (ServerThread), RAM tier only, shared segment",
               file="HiCacheFile in a temporary folder, page cache warm")
    plot(rows, out.with_suffix(".png"))
    return rows


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    fig, ax = figure(7, 4)
    ops = list(OPS)
    names = list(dict.fromkeys(r["backend"] for r in rows))
    width = 0.8 / len(names)
    for j, name in enumerate(names):
        ys = [next((r["gb_s"] for r in rows if r["op"] == op and r["backend"] == name), 0)
              for op in ops]
        ax.bar([i + j * width for i in range(len(ops))], ys, width, label=name)
    labels = {"get": "first read", "get_again": "same pages re-read\n(best case)",
              "set": "write"}
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(ops))],
                  [f"{labels[op]}\n({rows[0]['pages']} pages)" for op in ops])
    ax.set_ylabel("GB/s of fp16 pages")
    ax.set_title("SGLang HiCache L3: kdn backend vs HiCacheFile")
    ax.legend(fontsize=7)
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    ap = arg_parser(__doc__, "sglang", "32 pages, 2 repeats")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (1: SGLang's storage I/O runs on background "
                         "threads, and intra-op threads that share their cores make every "
                         "large torch op wait for a busy core)")
    ns = ap.parse_args(argv)
    torch.set_num_threads(ns.threads)
    run(32 if ns.quick else BATCH, 2 if ns.quick else 5, ns.out, ns.threads)


if __name__ == "__main__":
    main()
