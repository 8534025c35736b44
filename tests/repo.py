"""Small model repositories the tests write: python models with a gate, a fault, a variable dim."""

import os
import sys
import textwrap

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import make_models  # noqa: E402  (examples/make_models.py)

# Echo model: OUTPUT = INPUT, BATCH = the size of the batch each row ran in. A negative input
# holds the batch until the gate file disappears, so a test can keep the worker busy on purpose.
RECORDER_PY = '''
import os
import time

import numpy as np


class Model:
    def initialize(self, config):
        self.gate = config["parameters"].get("gate_file", "")
        self.fail_on = float(config["parameters"].get("fail_on", "nan"))
        self.sleep = float(config["parameters"].get("sleep_ms", "0")) / 1000

    def execute(self, inputs):
        x = inputs["INPUT"]
        if self.gate and (x < 0).any():
            deadline = time.monotonic() + 120
            while os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.005)
        if (x == self.fail_on).any():
            raise RuntimeError("asked to fail")
        if self.sleep:
            time.sleep(self.sleep)
        n = x.shape[0]
        return {"OUTPUT": x.copy(), "BATCH": np.full((n, 1), n, np.int32)}
'''

FAILING_INIT_PY = '''
class Model:
    def initialize(self, config):
        raise RuntimeError("this model cannot load: weights are missing")

    def execute(self, inputs):
        return {}
'''


# a python model whose version N computes INPUT + N: tells apart which version served a request
ADD_PY = '''
import numpy as np


class Model:
    def initialize(self, config):
        self.k = float(config["version_dir"].rstrip("/").rsplit("/", 1)[1])  # version N computes x + N

    def execute(self, inputs):
        return {"OUTPUT": inputs["INPUT"] + np.float32(self.k)}
'''


def write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text).lstrip())


def recorder(repo: str, name: str, *, max_batch: int = 16, preferred: str = "4, 8", delay_us: int = 10_000_000,
             gate: str = "", count: int = 1, extra: str = "", dims: str = "4") -> None:
    write(f"{repo}/{name}/1/model.py", RECORDER_PY)
    write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: {max_batch}
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ {dims} ] }} ]
        output [
          {{ name: "OUTPUT" data_type: TYPE_FP32 dims: [ {dims} ] }},
          {{ name: "BATCH" data_type: TYPE_INT32 dims: [ 1 ] }}
        ]
        instance_group [ {{ count: {count} kind: KIND_CPU }} ]
        dynamic_batching {{ preferred_batch_size: [ {preferred} ] max_queue_delay_microseconds: {delay_us} }}
        parameters {{ key: "gate_file" value: {{ string_value: "{gate}" }} }}
        parameters {{ key: "fail_on" value: {{ string_value: "-7" }} }}
        {extra}
    """)


def make_test_repo(repo: str, gate: str) -> str:
    """The examples plus the models the serving tests need."""
    make_models.make_all(repo)
    recorder(repo, "recorder", gate=gate)
    recorder(repo, "lone", delay_us=200_000)
    recorder(repo, "pair", max_batch=8, preferred="8", delay_us=1000, count=2)
    recorder(repo, "varlen", max_batch=4, preferred="4", delay_us=0, dims="-1",
             extra='parameters { key: "slot_bytes" value: { string_value: "64K" } }')
    write(f"{repo}/cannot_load/1/model.py", FAILING_INIT_PY)
    write(f"{repo}/cannot_load/config.pbtxt", """
        backend: "python"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
    """)
    write(f"{repo}/bad_config/config.pbtxt", """
        backend: "python"
        max_batch_size: 4
        input [ { name: "X" data_type: TYPE_FP32 dims: [ 1 ] } ]
        output [ { name: "Y" data_type: TYPE_FP32 dims: [ 1 ] } ]
        dynamic_batching { preferred_batch_size: [ 8 ] }
    """)
    write(f"{repo}/bad_config/1/model.py", FAILING_INIT_PY)
    return repo


BYTES_PY = '''
import numpy as np


class Model:
    def execute(self, inputs):
        text = inputs["TEXT"]
        upper = np.array([[s.upper()] for s in text[:, 0]], dtype=object)
        length = np.array([[len(s)] for s in text[:, 0]], dtype=np.int32)
        return {"UPPER": upper, "LENGTH": length}
'''


def bytes_model(repo: str, name: str = "shout") -> None:
    """A python model over BYTES: upper-cases each string and returns its length."""
    write(f"{repo}/{name}/1/model.py", BYTES_PY)
    write(f"{repo}/{name}/config.pbtxt", """
        backend: "python"
        max_batch_size: 8
        input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]
        output [
          { name: "UPPER" data_type: TYPE_STRING dims: [ 1 ] },
          { name: "LENGTH" data_type: TYPE_INT32 dims: [ 1 ] }
        ]
        dynamic_batching { }
    """)
