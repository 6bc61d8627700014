"""Regenerate the committed protobuf/gRPC modules from proto/fedhop.proto.

    python -m fedhop.common.wire.generate   # rewrite common/wire/fedhop_pb2*.py
    python -m fedhop.common.wire.generate OUT_DIR    # write them elsewhere (the freshness test does this)

Needs the `dev` extra (grpcio-tools).  grpc_tools emits `import fedhop_pb2`, which only works
with the output folder on sys.path, so the import is rewritten to the package path.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROTO = ROOT / "proto" / "fedhop.proto"
WIRE = Path(__file__).resolve().parent
FILES = ("fedhop_pb2.py", "fedhop_pb2.pyi", "fedhop_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc  # dev extra

    out_dir.mkdir(parents=True, exist_ok=True)
    args = ["protoc", f"-I{PROTO.parent}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed on " + str(PROTO))
    grpc_file = out_dir / "fedhop_pb2_grpc.py"
    text = grpc_file.read_text()
    grpc_file.write_text(text.replace("import fedhop_pb2 as fedhop__pb2",
                                      "from fedhop.common.wire import fedhop_pb2 as fedhop__pb2"))
    return [out_dir / f for f in FILES]


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else WIRE)
