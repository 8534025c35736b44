"""Model repositories for the GE backend: an ONNX network wrapped in a stand-in `.om` (tests/standin)."""

import json
import os

import numpy as np

from tests.repo import write

STANDIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "standin")


def net(path: str, width: int = 16, out: int = 4) -> None:
    """A small fixed-seed network, batch dimension free: y = relu(x W1 + b1) W2."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.repo import make_models

    rng = np.random.default_rng(5)
    w1 = rng.standard_normal((width, 32)).astype(np.float32)
    b1 = rng.standard_normal(32).astype(np.float32)
    w2 = rng.standard_normal((32, out)).astype(np.float32)
    x = helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", width])
    y = helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", out])
    nodes = [helper.make_node("Gemm", ["input", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["output"])]
    inits = [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")]
    make_models._save(helper.make_graph(nodes, "net", [x], [y], inits), path)


def ge_model(repo: str, name: str, *, gears=(1, 2, 4, 8), batch: int = 0, max_batch: int = 8, devices=(0,),
             count: int = 1, stream_num: int = 2, preferred: str = "", delay_us: int = 0, faults: dict | None = None,
             params: dict | None = None) -> str:
    version = os.path.join(repo, name, "1")
    net(os.path.join(version, "net.onnx"))
    om = {"onnx": "net.onnx", **({"gears": list(gears)} if gears else {"batch": batch}), **(faults or {})}
    write(os.path.join(version, "model.om"), json.dumps(om))
    pref = f"preferred_batch_size: [ {preferred} ]" if preferred else ""
    extra = "\n".join(f'parameters {{ key: "{k}" value: {{ string_value: "{v}" }} }}'
                      for k, v in {"stream_num": stream_num, **(params or {})}.items())
    write(os.path.join(repo, name, "config.pbtxt"), f"""
        backend: "ge"
        max_batch_size: {max_batch}
        input [ {{ name: "input" data_type: TYPE_FP32 dims: [ 16 ] }} ]
        output [ {{ name: "output" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        instance_group [ {{ count: {count} kind: KIND_ASCEND ascend_devices: [ {", ".join(map(str, devices))} ]
                           policy: load_balance }} ]
        dynamic_batching {{ {pref} max_queue_delay_microseconds: {delay_us} }}
        {extra}
    """)
    return os.path.join(version, "net.onnx")


def reports(folder: str) -> list[dict]:
    out = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("acl-") and name.endswith(".json"):
            with open(os.path.join(folder, name)) as f:
                out.append(json.load(f))
    return out


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "tools")


def run_script(script: str, *args: str, env: dict | None = None, timeout: float = 120) -> dict:
    """Runs ``script`` in a fresh interpreter with the stand-in on its path; returns the JSON it prints last."""
    import subprocess
    import sys

    full = dict(os.environ, **(env or {}))
    full["PYTHONPATH"] = os.pathsep.join([STANDIN, TOOLS, full.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=full,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
