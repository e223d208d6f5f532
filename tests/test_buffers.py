"""Receive buffers of large entries are recycled (kdn.transport.buffers): a buffer is written
again only once no view of its previous use exists; free memory stays within its bound; through
the server, overwrites reuse buffers and every read still returns what was stored with it."""

from __future__ import annotations

import dataclasses
import gc
import os

import numpy as np
import pytest

from kdn.client import Client
from kdn.server import ServerConfig, ServerThread
from kdn.transport.buffers import _WATCHED, MIN_BYTES, BufferPool, on_release
from tests.helpers import random_kv, uniform_layout


def test_a_buffer_comes_back_only_when_its_last_view_is_gone() -> None:
    pool = BufferPool(keep_bytes=64 << 20)
    a = pool.take(3 << 20)
    a[:] = 7
    frame = memoryview(a).toreadonly()[1 << 20: 2 << 20]  # a reader's slice, as Retrieve sends
    del a
    gc.collect()
    assert pool.free_bytes == 0  # the slice keeps the buffer out of the pool
    b = pool.take(3 << 20)
    b[:] = 9
    assert pool.created == 2 and pool.reused == 0
    assert bytes(frame[:8]) == b"\x07" * 8  # the reader still sees its own bytes
    del frame
    gc.collect()
    assert pool.free_bytes == 3 << 20
    c = pool.take((3 << 20) - 100)  # close enough in size: reused
    assert pool.reused == 1 and pool.free_bytes == 0 and len(c) == (3 << 20) - 100
    del b, c


def test_a_release_watch_fires_once_on_the_thread_that_lets_go_and_is_then_forgotten() -> None:
    """``on_release`` (what buffers and arena slots are given back by): the call comes once,
    when the last reference goes, on the thread that dropped it, for an array (no hash) as
    for any object; nothing of the watch is left afterwards, and a watched object alive in a
    cycle is not released before the collector frees it."""
    import threading

    got: list[tuple[str, str]] = []
    tags = [f"a{i}" for i in range(3)] + ["never held", "in a cycle"]

    def watched() -> int:
        """This test's watches still held. Only these: ``_WATCHED`` is the process's, and
        the ``gc.collect`` below also frees what earlier tests left in cycles (a watched
        buffer among it goes too), so the set's size says nothing about this test."""
        return sum(1 for ref in list(_WATCHED) if any(ref.arg is tag for tag in tags))

    arrays = [np.zeros(8, dtype=np.uint8) for _ in range(3)]
    for i, a in enumerate(arrays):
        on_release(memoryview(a) if i == 2 else a, lambda tag: got.append(
            (tag, threading.current_thread().name)), tags[i])
    assert watched() == 2  # the memoryview went at once
    assert got == [("a2", threading.current_thread().name)]
    view = arrays[0][:4]  # a numpy slice keeps its base alive
    del arrays[0]
    assert len(got) == 1
    t = threading.Thread(target=lambda: arrays.clear(), name="dropper")
    t.start()
    t.join()
    assert got[1:] == [("a1", "dropper")]
    del view
    assert got[2:] == [("a0", threading.current_thread().name)]
    on_release(np.zeros(1), lambda tag: got.append((tag, "")), tags[3])
    holder = [np.zeros(2)]
    holder.append(holder)
    on_release(holder[0], lambda tag: got.append((tag, "")), tags[4])
    del holder
    assert got[-1][0] == "never held"
    gc.collect()
    assert got[-1][0] == "in a cycle" and watched() == 0


def test_sizes_far_apart_do_not_share_and_free_memory_stays_bounded() -> None:
    pool = BufferPool(keep_bytes=8 << 20)
    for _ in range(3):
        x = pool.take(5 << 20)
        del x
    assert pool.created == 1 and pool.reused == 2 and pool.free_bytes == 5 << 20
    small = pool.take(1 << 20)  # a 5 MiB buffer is not handed out for 1 MiB
    assert pool.created == 2
    del small
    assert pool.free_bytes == 6 << 20
    big = pool.take(7 << 20)
    del big  # 7 MiB more would pass 8 MiB: the oldest free buffers are unmapped first
    assert pool.free_bytes <= 8 << 20
    huge = pool.take(9 << 20)
    del huge  # larger than the bound: not kept at all
    assert pool.free_bytes <= 8 << 20
    pool.clear()
    assert pool.free_bytes == 0
    with pytest.raises(ValueError, match="must be > 0"):
        pool.take(0)


def test_a_buffer_is_never_rewritten_under_a_numpy_reader() -> None:
    pool = BufferPool(keep_bytes=64 << 20)
    a = pool.take(2 << 20)
    a[:] = 1
    reader = np.frombuffer(memoryview(a).toreadonly(), dtype=np.uint8)[:16]
    del a
    for _ in range(5):
        b = pool.take(2 << 20)
        b[:] = 2
        del b
    assert reader.tolist() == [1] * 16


def test_overwrites_through_the_server_reuse_buffers_and_reads_stay_whole(
        server_config: ServerConfig) -> None:
    layout = uniform_layout(layers=4, heads=4, dim=64)
    tokens = MIN_BYTES // layout.bytes_per_token + 64  # every entry above MIN_BYTES
    kvs = [random_kv(layout, tokens, seed=s) for s in range(4)]
    server = ServerThread(dataclasses.replace(server_config, shm_arena_bytes=0)).start()
    c = Client(server.address, timeout_s=30)  # a shared segment: PutMany copies into buffers
    try:  # (no arenas: there same-host stores live in the tenant's read arena instead)
        held = []
        for i in range(12):
            kv = kvs[i % len(kvs)]
            if i % 2:  # a Store stream: kept as its frames (kdn.store.framed), no buffer
                c.store(b"k" * 32, kv, mode="raw")
            else:
                c.store_many([(b"k" * 32, kv)], mode="raw")
            if i % 3 == 0:  # a stream left open over an entry about to be overwritten
                stream = c.retrieve_stream(b"k" * 32)
                assert stream is not None
                held.append((stream, kv))
            back = c.retrieve(b"k" * 32, layout=layout)
            assert back is not None and back.equal(kv)
        for stream, kv in held:
            for layer in range(layout.num_layers):
                k, v = stream.wait_for_layer(layer)
                assert np.array_equal(k.numpy(), kv.layers[layer][0].numpy())
                assert np.array_equal(v.numpy(), kv.layers[layer][1].numpy())
        counters = c.stats().counters
        assert counters["buffers.reused"] >= 4 and counters["buffers.created"] <= 3
    finally:
        c.close()
        server.stop()


def test_a_new_buffer_is_faulted_in_whole_when_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    """A buffer the pool makes for bytes the caller has comes with its pages already in (one
    populate call, not a page fault per 4 KiB as it is first written); one for a size a peer
    declared does not (hostile sizes must not take memory before their bytes come)."""
    import ctypes
    import os

    from kdn.transport.buffers import MADV_POPULATE_WRITE, libc_madvise

    page = os.sysconf("SC_PAGE_SIZE")
    libc = ctypes.CDLL(None, use_errno=True)
    mincore = libc.mincore
    mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def resident(addr: int, n: int) -> tuple[int, int]:
        """(pages in memory, pages) of the whole pages inside [addr, addr + n)."""
        first, end = -(-addr // page) * page, (addr + n) // page * page
        pages = (end - first) // page
        vec = (ctypes.c_ubyte * pages)()
        assert mincore(first, pages * page, vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec), pages

    # The memory the pool gets must have no pages in before the call. Past glibc's mmap
    # threshold a request is mapped afresh only when the heap has no free chunk that fits:
    # glibc looks at its free chunks (and the heap's top) first, whatever the size. A server
    # or client earlier in this process raised the trim threshold (tune_allocator: up to
    # 512 MiB of free heap kept, its pages still in), and a request served from there came
    # back with all its pages in (12159 of 12159 after 1,095 other tests). That memory is the
    # process's already, not new memory taken for a declared size, so the pool is right to
    # use it; the check needs a heap that keeps no free pages, which malloc_trim makes it.
    malloc_trim = getattr(libc, "malloc_trim", None)  # glibc; elsewhere nothing kept to trim
    if malloc_trim is not None:
        malloc_trim(0)
    size = 48 << 20  # past glibc's mmap threshold: freshly mapped where the heap cannot serve
    probe = np.empty(size, dtype=np.uint8)
    if libc_madvise() is None or libc_madvise()(probe.ctypes.data // page * page, page,
                                                MADV_POPULATE_WRITE) != 0:
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    del probe
    pool = BufferPool(keep_bytes=0)
    buf = pool.take(size - (1 << 19), written_now=True)
    got, pages = resident(buf.ctypes.data, buf.nbytes)
    assert pages > 0 and got == pages
    # A size the caller does not write at once (one a peer declared) is not populated. Its
    # pages in memory can not tell: the heap may serve it from memory the process already
    # holds (another thread's frees after the trim: 378 of 12160 pages once, all 12159 in
    # another run), so the populate calls are counted instead.
    from kdn.transport import buffers

    populated: list[int] = []
    real = buffers.populate
    monkeypatch.setattr(buffers, "populate", lambda a: (populated.append(a.nbytes), real(a)))
    lazy = pool.take(size - (1 << 19))
    assert populated == [] and lazy.nbytes == size - (1 << 19)
    again = pool.take(size - (1 << 19), written_now=True)  # the count sees a populate call
    assert populated == [again.nbytes]


def _access(address: int) -> str:
    """The read and write permissions of the mapping at ``address`` ("rw", "r-")."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            low, high = (int(x, 16) for x in span.split("-"))
            if low <= address < high:
                return perms[:2]
    return ""


@pytest.mark.parametrize("writable", [False, True], ids=["read-only", "copy-on-write"])
def test_pages_made_the_processs_own_keep_their_bytes_when_the_file_changes(
        writable: bool) -> None:
    """``own_pages`` (what a closing client does to the read arena's pages it still shows):
    the pages hold what they showed, writes of this process into them included, and the file
    under them is then written unseen."""
    import mmap

    from kdn.transport.buffers import own_pages

    page = mmap.PAGESIZE
    fd = os.memfd_create("kdn-test")
    try:
        os.ftruncate(fd, 4 * page)
        server = mmap.mmap(fd, 4 * page)  # the file's writer
        server[:] = bytes(range(256)) * (4 * page // 256)
        if writable:
            view = mmap.mmap(fd, 4 * page, flags=mmap.MAP_PRIVATE,
                             prot=mmap.PROT_READ | mmap.PROT_WRITE)
        else:
            view = mmap.mmap(fd, 4 * page, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    shown = np.frombuffer(view, dtype=np.uint8)
    if writable:
        shown[page + 5] = 99  # this process's own write, on a page copied on write
    before = shown.copy()
    assert own_pages(shown.ctypes.data + page, 2 * page, writable=writable)
    assert not own_pages(shown.ctypes.data + 1, page, writable=writable)  # whole pages only
    server[:] = b"\xff" * (4 * page)
    assert np.array_equal(shown[page : 3 * page], before[page : 3 * page])  # its own copy
    assert (shown[:page] == 0xFF).all() and (shown[3 * page :] == 0xFF).all()  # the file's
    assert _access(shown.ctypes.data + page) == ("rw" if writable else "r-")  # as it was
    del shown
    view.close()
    server.close()


def test_a_size_the_host_can_not_allocate_is_too_large_not_a_memory_error() -> None:
    """A Store header may declare more bytes than the host has (up to max_entry_bytes, set
    large): numpy's MemoryError reached the peer as UNKNOWN with numpy's text; it is TooLarge
    (RESOURCE_EXHAUSTED), naming the size."""
    from kdn.errors import TooLarge

    pool = BufferPool(keep_bytes=64 << 20)
    with pytest.raises(TooLarge, match=f"{1 << 52} bytes can not be allocated on this host"):
        pool.take(1 << 52)  # 4 PiB
    assert len(pool.take(MIN_BYTES)) == MIN_BYTES  # the pool still serves
