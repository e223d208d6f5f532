"""The storage side runs without torch: a process where importing torch, transformers or numba
fails starts the server, stores an entry over gRPC (bytes built by the container format, which
is torch-free), reads it back and runs admin calls."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = textwrap.dedent('''
    import importlib.abc, sys, tempfile
    from pathlib import Path

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name.split(".")[0] in ("torch", "transformers", "numba", "triton"):
                raise ImportError(f"{name} is not installed here")

    sys.meta_path.insert(0, NoTorch())

    import grpc
    from kdn.codec.format import build_header, frame_with_sum, record_parts, FRAME_SEED
    from kdn.layout import KVLayout, LayerLayout
    from kdn.codec.layouts import layout_to_proto
    from kdn.server import ServerConfig, ServerThread
    from kdn.v1 import kdn_pb2 as pb, kdn_pb2_grpc as pb_grpc
    from kdn.transport.wire import frame_message

    lay = KVLayout("no-torch", (LayerLayout(2, 4, 4), LayerLayout(2, 4, 4)), head_dim=4)
    tokens = 3
    body = bytes(range(2 * tokens * 8 * 2))  # raw fp16 K then V of one layer
    built = [frame_with_sum(FRAME_SEED, i, i, [record_parts(x, tokens, body)])
             for i, x in enumerate(lay.layers)]
    entry = pb.EntryHeader(layout=layout_to_proto(lay), codec=pb.Codec(mode="raw"),
                           tokens=tokens, layout_fingerprint=lay.fingerprint,
                           frames=[pb.FrameSpan(first_layer=i, num_layers=1, checksum=s)
                                   for i, (_, s) in enumerate(built)])
    header = build_header(entry)
    frames = [f for f, _ in built]
    key = bytes(range(32))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(port=0, data_dir=Path(tmp), disk_bytes=64 << 20)
        with ServerThread(cfg) as st, grpc.insecure_channel(st.address) as ch:
            stub = pb_grpc.KDNStub(ch)
            msgs = [pb.StoreRequest(header=pb.StoreHeader(
                key=key, container_header=header,
                total_bytes=len(header) + sum(map(len, frames))))]
            msgs += [pb.StoreRequest.FromString(frame_message(i, f))
                     for i, f in enumerate(frames)]
            stub.Store(iter(msgs))
            back = list(stub.Retrieve(pb.RetrieveRequest(key=key)))
            assert back[0].header.container_header == header
            assert [m.frame.data for m in back[1:]] == frames
            admin = pb_grpc.KDNAdminStub(ch)
            listed = admin.List(pb.ListRequest())
            assert any(e.key == key for e in listed.entries), listed
            report = [p for p in admin.Verify(pb.VerifyRequest(dry_run=True)) if p.done]
            assert report and all(p.corrupt == 0 for p in report)
    assert "torch" not in sys.modules and "numba" not in sys.modules
    print("ok")
''')


def test_the_server_stores_and_serves_without_torch() -> None:
    run = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
