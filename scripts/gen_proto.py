"""Regenerate kdn/v1/*_pb2*.py from protos/kdn/v1/kdn.proto (run after editing the proto).

    python scripts/gen_proto.py [--out DIR]

tests/test_proto.py regenerates into a temporary folder and fails if the checked-in code differs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO = "kdn/v1/kdn.proto"


def generate(out: Path) -> list[Path]:
    from grpc_tools import protoc

    out.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{ROOT / 'protos'}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(ROOT / "protos" / PROTO),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out / "kdn" / "v1").glob("kdn_pb2*"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=ROOT)
    ns = ap.parse_args()
    for p in generate(ns.out):
        print(p.relative_to(ns.out))


if __name__ == "__main__":
    sys.exit(main())
