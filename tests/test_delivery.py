"""Layer-by-layer delivery: layers become usable while later frames are still on the wire."""

from __future__ import annotations

from pathlib import Path

import pytest

from kdn import keys
from kdn.client import Client
from kdn.errors import InvalidArgument
from kdn.server import ServerConfig, ServerThread
from tests.helpers import random_kv, uniform_layout


def test_layer_zero_usable_before_last_frame_arrives(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=1 << 30)
    lay = uniform_layout(layers=48, heads=4, dim=64)
    kv = random_kv(lay, tokens=1024)  # 1 MiB per layer frame, 48 frames
    key = keys.chunk_key([7], lay)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0, data_path=False) as c:
        c.store(key, kv, mode="raw")
        stream = c.retrieve_stream(key, layout=lay)
        assert stream is not None
        k0, v0 = stream.wait_for_layer(0)
        assert k0.equal(kv.layers[0][0]) and v0.equal(kv.layers[0][1])
        back = stream.result(timeout=60)
        t = stream.timings
        assert t.layer_ready[0] < t.last_frame_received, (
            "layer 0 was only ready after the whole entry had arrived"
        )
        assert back.equal(kv)
        assert t.bytes_received > kv.nbytes


def test_layer_window_and_errors(tmp_path: Path) -> None:
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0)
    lay = uniform_layout(layers=6)
    kv = random_kv(lay, tokens=8)
    key = keys.chunk_key([8], lay)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0, data_path=False) as c:
        c.store(key, kv, mode="lossless", layers_per_frame=2)
        stream = c.retrieve_stream(key, first_layer=2, last_layer=4)
        assert stream is not None
        for i in (2, 3):
            k, v = stream.wait_for_layer(i, timeout=30)
            assert k.equal(kv.layers[i][0])
        # outside the window: said so (it said "stream ended without layers [0, 1, 4, 5]",
        # as a damaged answer would), and result() (every layer) likewise
        for outside in (0, 5):
            with pytest.raises(InvalidArgument, match=rf"layer {outside} is outside the "
                                                      r"requested window \[2, 4\)"):
                stream.wait_for_layer(outside, timeout=30)
        with pytest.raises(InvalidArgument, match=r"only layers \[2, 4\)"):
            stream.result(timeout=30)
        assert c.retrieve_stream(keys.chunk_key([9], lay)) is None


def test_a_layer_index_outside_the_stream_is_refused(tmp_path: Path) -> None:
    """wait_for_layer(-1) handed out the last layer's K/V and is_ready(-1) was True; an index
    past the last layer was a bare IndexError; a window starting past the last layer gave a
    stream whose every wait said it ended without layers. Each is InvalidArgument now,
    naming the index and the layer count."""
    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0)
    lay = uniform_layout(layers=4)
    kv = random_kv(lay, tokens=8)
    key = keys.chunk_key([10], lay)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0, data_path=False) as c:
        c.store(key, kv, mode="lossless")
        stream = c.retrieve_stream(key)
        assert stream is not None
        assert stream.wait_for_layer(3, timeout=30)[0].equal(kv.layers[3][0])
        for bad in (-1, 4, 1.0, True):
            with pytest.raises(InvalidArgument, match=f"layer index .*below 4.*got {bad!r}"):
                stream.wait_for_layer(bad, timeout=30)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument, match="below 4"):
                stream.is_ready(bad)  # type: ignore[arg-type]
        for first, last in ((4, 0), (9, 0), (4, 6)):
            with pytest.raises(InvalidArgument, match=f"first_layer {first} is past the "
                               "entry's 4 layers"):
                c.retrieve_stream(key, first_layer=first, last_layer=last)
        [pending] = c.retrieve_streams([key])
        assert pending is not None
        with pytest.raises(InvalidArgument, match="below 4"):
            pending.wait_for_layer(-1, timeout=30)
        with pytest.raises(InvalidArgument, match="layer index"):
            pending.is_ready(-1)
        assert pending.wait_for_layer(0, timeout=30)[1].equal(kv.layers[0][1])


def test_cancel_and_deadline_stop_server_work(tmp_path: Path) -> None:
    import time

    from kdn.errors import DeadlineExceeded

    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=1 << 30)
    lay = uniform_layout(layers=64, heads=4, dim=64)
    kv = random_kv(lay, tokens=4096)  # 64 frames of 4 MiB: longer to send than the deadline
    key = keys.chunk_key([5], lay)
    with ServerThread(cfg) as st, Client(st.address, shm_bytes=0, data_path=False) as c:
        c.store(key, kv, mode="raw")

        def counters() -> dict[str, int]:
            return dict(c.stats().counters)

        stream = c.retrieve_stream(key)
        assert stream is not None
        stream.wait_for_layer(0, timeout=30)
        stream.cancel()
        deadline = time.time() + 10
        while counters().get("retrieve.cancelled", 0) < 1 and time.time() < deadline:
            time.sleep(0.05)
        sent = counters().get("retrieve.frames_sent", 0)
        assert counters()["retrieve.cancelled"] == 1
        assert sent < 64, f"server sent all {sent} frames of a cancelled stream"
        time.sleep(0.3)
        assert counters().get("retrieve.frames_sent", 0) == sent  # and it stays stopped

        # The deadline passes during the frames, or, on a busy host, before the header came:
        # either way the server stops sending (a stream it had begun counts as cancelled).
        begun = False
        with Client(st.address, timeout_s=0.05, shm_bytes=0, data_path=False) as hurried:
            with pytest.raises(DeadlineExceeded):
                stream = hurried.retrieve_stream(key)
                begun = True
                assert stream is not None
                stream.result(timeout=30)
        if begun:
            deadline = time.time() + 10
            while counters().get("retrieve.cancelled", 0) < 2 and time.time() < deadline:
                time.sleep(0.05)
            assert counters()["retrieve.cancelled"] == 2
        time.sleep(0.3)
        late = counters().get("retrieve.frames_sent", 0)
        assert late - sent < 64, "the server sent the whole entry past the client's deadline"
        time.sleep(0.3)
        assert counters().get("retrieve.frames_sent", 0) == late


def test_concurrent_streams_share_the_server(tmp_path: Path) -> None:
    """Four clients retrieving a large entry at once progress together: no stream finishes
    before every other stream is well under way (the server interleaves their frames)."""
    import threading
    import time

    cfg = ServerConfig(port=0, data_dir=tmp_path, disk_bytes=0, ram_bytes=1 << 30)
    lay = uniform_layout(layers=48, heads=4, dim=64)
    kv = random_kv(lay, tokens=1024)
    key = keys.chunk_key([6], lay)
    n = 4
    progress: list[list[float]] = [[] for _ in range(n)]
    barrier = threading.Barrier(n)
    with ServerThread(cfg) as st:
        with Client(st.address, shm_bytes=0, data_path=False) as c:
            c.store(key, kv, mode="raw")

        def run(w: int) -> None:
            with Client(st.address, shm_bytes=0, data_path=False) as c:
                barrier.wait()
                stream = c.retrieve_stream(key)
                assert stream is not None
                for i in range(lay.num_layers):
                    stream.wait_for_layer(i, timeout=60)
                    progress[w].append(time.perf_counter())

        threads = [threading.Thread(target=run, args=(w,)) for w in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    first_done = min(p[-1] for p in progress)
    for p in progress:
        assert len(p) == lay.num_layers
        reached = sum(1 for x in p if x <= first_done)
        assert reached >= lay.num_layers // 4, (
            f"a stream had only {reached}/{lay.num_layers} layers when another finished"
        )
