"""The storage side runs without torch: a process where importing torch, transformers or numba
fails starts the server, stores an entry over gRPC (bytes built by the container format, which
is torch-free), reads it back and runs admin calls. Without the model extra, what needs it
says so: MissingExtra naming the extra and how to install it."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

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


_MISSING_EXTRA = textwrap.dedent('''
    import sys, tempfile
    from pathlib import Path

    class Hidden:  # each finder as installed, but the model extra's packages are not found
        def __init__(self, inner):
            self.inner = inner
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in sys.argv[1].split(","):
                return None
            find = getattr(self.inner, "find_spec", None)
            return find(name, path, target) if find else None

    sys.meta_path[:] = [Hidden(f) for f in sys.meta_path]

    import importlib
    import grpc
    import kdn
    from kdn.cli.args import model_problem
    from kdn.codec.format import build_header, frame_with_sum, record_parts, FRAME_SEED
    from kdn.codec.layouts import layout_to_proto
    from kdn.errors import MissingExtra
    from kdn.layout import KVLayout, LayerLayout
    from kdn.server import ServerConfig, ServerThread
    from kdn.transport.wire import frame_message
    from kdn.v1 import kdn_pb2 as pb, kdn_pb2_grpc as pb_grpc

    def refused(what, get):
        try:
            get()
        except MissingExtra as e:
            assert "kdn[model]" in str(e) and what in str(e), e
            assert isinstance(e, ModuleNotFoundError)
        else:
            raise AssertionError(f"{what}: no MissingExtra")

    problem = model_problem("smollm2-135m")
    assert problem and "kdn[model]" in problem, problem
    assert all(m in problem for m in sys.argv[1].split(",")), problem
    if sys.argv[1] != "torch,transformers,numba,constriction,gguf,accelerate":
        print("ok")
        raise SystemExit
    refused("kdn.model", lambda: importlib.import_module("kdn.model.hf"))
    refused("kdn.engine", lambda: importlib.import_module("kdn.engine"))
    refused("kdn.blend", lambda: importlib.import_module("kdn.blend"))
    refused("kdn.KVCache", lambda: kdn.KVCache)
    refused("kdn.codec.encode", lambda: importlib.import_module("kdn.codec").encode)
    refused("kdn.rag.RagEngine", lambda: importlib.import_module("kdn.rag").RagEngine)

    lay = KVLayout("no-torch", (LayerLayout(2, 4, 4),), head_dim=4)
    built = frame_with_sum(FRAME_SEED, 0, 0, [record_parts(lay.layers[0], 3, bytes(96))])
    header = build_header(pb.EntryHeader(
        layout=layout_to_proto(lay), codec=pb.Codec(mode="raw"), tokens=3,
        layout_fingerprint=lay.fingerprint,
        frames=[pb.FrameSpan(first_layer=0, num_layers=1, checksum=built[1])]))
    key = bytes(range(32))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = ServerConfig(port=0, data_dir=Path(tmp), disk_bytes=64 << 20)
        with ServerThread(cfg) as st, grpc.insecure_channel(st.address) as ch:
            pb_grpc.KDNStub(ch).Store(iter([
                pb.StoreRequest(header=pb.StoreHeader(
                    key=key, container_header=header, total_bytes=len(header) + len(built[0]))),
                pb.StoreRequest.FromString(frame_message(0, built[0]))]))
            with kdn.Client(st.address) as client:
                assert client.retrieve(bytes(32)) is None  # a miss needs no tensors
                refused("Client.retrieve", lambda: client.retrieve(key))
    print("ok")
''')


@pytest.mark.parametrize("hidden", ["torch,transformers,numba,constriction,gguf,accelerate",
                                    "numba", "constriction"])
def test_the_model_side_without_its_extra_names_the_extra(hidden: str) -> None:
    """Without (part of) the model extra, the README's model-side imports and a Client read
    into tensors raise MissingExtra naming ``pip install 'kdn[model]'`` (a bare 'No module
    named torch' before), and the CLI's model check names every package of it that is
    missing (it checked torch and transformers only: numba missing died in a traceback)."""
    run = subprocess.run([sys.executable, "-c", _MISSING_EXTRA, hidden], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
