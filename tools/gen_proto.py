"""Regenerates the pb2 modules in gepool/common from their .proto files (needs grpcio-tools).

The runtime-version check that new protoc releases write into generated code is removed, so the
modules import on any protobuf >= 4.21 (the descriptor-builder API they use dates from 3.20).
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTOS = ("gepool/common/model_config.proto", "gepool/common/onnx_subset.proto")


def main() -> None:
    for proto in PROTOS:
        subprocess.run([sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}", proto],
                       check=True)
        out = ROOT / proto.replace(".proto", "_pb2.py")
        text = out.read_text()
        text = re.sub(r"from google\.protobuf import runtime_version as _runtime_version\n", "", text)
        text = re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", "", text, flags=re.S)
        out.write_text(text)


if __name__ == "__main__":
    main()
