"""Warm-up runs before a model is READY; a failing warm-up keeps it unavailable with the reason."""

import os

import numpy as np

from gepool import Pool
from tests.repo import write

COUNTER_PY = '''
import numpy as np


class Model:
    calls = 0

    def execute(self, inputs):
        x = inputs["INPUT"]
        if (x == -1).all():
            raise ValueError("cannot run on all -1")
        Model.calls += 1
        return {"COUNT": np.full((x.shape[0], 1), Model.calls, np.int32)}
'''


def counter(repo: str, name: str, extra: str) -> None:
    write(f"{repo}/{name}/1/model.py", COUNTER_PY)
    write(f"{repo}/{name}/config.pbtxt", f"""
        backend: "python"
        max_batch_size: 8
        input [ {{ name: "INPUT" data_type: TYPE_FP32 dims: [ 4 ] }} ]
        output [ {{ name: "COUNT" data_type: TYPE_INT32 dims: [ 1 ] }} ]
        dynamic_batching {{ preferred_batch_size: [ 2, 4 ] max_queue_delay_microseconds: 100 }}
        {extra}
    """)


def test_warmup_before_ready_and_failing_warmup(tmp_path):
    repo = str(tmp_path)
    counter(repo, "explicit", """
        model_warmup [ { name: "w" batch_size: 2 count: 3
                         inputs { key: "INPUT" value: { data_type: TYPE_FP32 dims: [ 4 ] random_data: true } } } ]
    """)
    counter(repo, "default", "")
    counter(repo, "failing", """
        model_warmup [ { name: "bad" batch_size: 1 count: 1
                         inputs { key: "INPUT" value: { data_type: TYPE_FP32 dims: [ 4 ] input_data_file: "ones" } } } ]
    """)
    os.makedirs(f"{repo}/failing/warmup", exist_ok=True)
    np.full(4, -1, np.float32).tofile(f"{repo}/failing/warmup/ones")
    with Pool(repo) as pool:
        models = pool.status["models"]
        assert models["explicit"]["state"] == "READY" and models["default"]["state"] == "READY"
        assert models["failing"]["state"] == "UNAVAILABLE"
        assert "warmup 'bad' failed: ValueError: cannot run on all -1" in models["failing"]["reason"]
        c = pool.client()
        x = np.ones((1, 4), np.float32)
        assert c.infer("explicit", {"INPUT": x})["COUNT"][0, 0] == 4  # 3 warm-up runs came first
        assert c.infer("default", {"INPUT": x})["COUNT"][0, 0] == 5  # 2 runs at each preferred size (2, 4)
