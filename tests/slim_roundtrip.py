"""Run by ``tests/test_slim_install.py`` with the python of a venv where only ``pip install kdn``
(no extras) went: torch must be absent, and ``kdn serve`` + a store/retrieve over gRPC + the
admin CLI must work. Argument: the server's address. Prints ``ok`` at the end."""

import json
import subprocess
import sys
from pathlib import Path

import grpc

from kdn.codec.format import FRAME_SEED, build_header, frame_with_sum, record_parts
from kdn.codec.layouts import layout_to_proto
from kdn.layout import KVLayout, LayerLayout
from kdn.transport.wire import frame_message
from kdn.v1 import kdn_pb2 as pb
from kdn.v1 import kdn_pb2_grpc as pb_grpc

try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    raise SystemExit("torch is importable in the slim install")

address = sys.argv[1]
kdn = str(Path(sys.executable).with_name("kdn"))
lay = KVLayout("slim", (LayerLayout(2, 4, 4), LayerLayout(2, 4, 4)), head_dim=4)
tokens = 3
body = bytes(range(2 * tokens * 8 * 2))  # raw fp16 K then V of one layer
built = [frame_with_sum(FRAME_SEED, i, i, [record_parts(x, tokens, body)])
         for i, x in enumerate(lay.layers)]
entry = pb.EntryHeader(layout=layout_to_proto(lay), codec=pb.Codec(mode="raw"), tokens=tokens,
                       layout_fingerprint=lay.fingerprint,
                       frames=[pb.FrameSpan(first_layer=i, num_layers=1, checksum=s)
                               for i, (_, s) in enumerate(built)])
header = build_header(entry)
frames = [f for f, _ in built]
key = bytes(range(32))
with grpc.insecure_channel(address) as ch:
    stub = pb_grpc.KDNStub(ch)
    msgs = [pb.StoreRequest(header=pb.StoreHeader(
        namespace="slim", key=key, container_header=header,
        total_bytes=len(header) + sum(map(len, frames))))]
    msgs += [pb.StoreRequest.FromString(frame_message(i, f)) for i, f in enumerate(frames)]
    stub.Store(iter(msgs), timeout=30)
    back = list(stub.Retrieve(pb.RetrieveRequest(namespace="slim", key=key), timeout=30))
    assert back[0].header.container_header == header
    assert [m.frame.data for m in back[1:]] == frames


def admin(*args: str) -> str:
    run = subprocess.run([kdn, "admin", *args, "--address", address], capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, (args, run.stderr)
    return run.stdout


(row,) = json.loads(admin("ls", "--namespace", "slim", "-o", "json"))
assert row["key"] == key.hex() and row["model_fingerprint"] == "slim", row
assert row["tokens"] == tokens and row["tiers"] == ["ram", "disk"], row
assert json.loads(admin("health", "-o", "json"))["status"] == "SERVING"
assert json.loads(admin("stats", "-o", "json"))["counters"]["store.ok"] == 1
# the model features say what to install, in one line, exit 2
run = subprocess.run([kdn, "serve", "--model", "smollm2-135m"], capture_output=True, text=True,
                     timeout=60)
assert run.returncode == 2 and "bootstrap.sh model" in run.stderr, run.stderr
assert len(run.stderr.strip().splitlines()) == 1, run.stderr
assert "torch" not in sys.modules
print("ok")
