"""Regenerates gepool/common/model_config_pb2.py from gepool/common/model_config.proto (needs grpcio-tools).

The runtime-version check that new protoc releases write into generated code is removed, so the
module imports on any protobuf >= 4.21 (the descriptor-builder API it uses dates from 3.20).
"""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def main() -> None:
    subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{ROOT}", f"--python_out={ROOT}",
         "gepool/common/model_config.proto"],
        check=True,
    )
    out = ROOT / "gepool" / "common" / "model_config_pb2.py"
    text = out.read_text()
    text = re.sub(r"from google\.protobuf import runtime_version as _runtime_version\n", "", text)
    text = re.sub(r"_runtime_version\.ValidateProtobufRuntimeVersion\([^)]*\)\n", "", text, flags=re.S)
    out.write_text(text)


if __name__ == "__main__":
    main()
