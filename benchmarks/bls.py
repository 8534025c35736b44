"""What one BLS hop costs: a python model calling `tiny` once, against the client calling `tiny` itself.

    python benchmarks/bls.py [--seconds 5] [--concurrency 1,16]

Three models on one pool: `tiny` (ONNX, y = 2x + 1), `local` (a python model computing 2x + 1 in numpy:
the python model's own cost) and `hop` (a python model calling `tiny` through its pool handle). The BLS
hop's cost is hop's latency less local's; set it beside a client's round trip to `tiny`.
"""

import argparse
import os
import statistics
import sys
import tempfile
import textwrap
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

WIDTH = 16
HOP_PY = '''
class Model:
    def initialize(self, config):
        self.pool = config["pool"]

    def execute(self, inputs):
        return {"OUTPUT0": self.pool.infer("tiny", {"INPUT0": inputs["INPUT0"]})["OUTPUT0"]}
'''
LOCAL_PY = '''
class Model:
    def execute(self, inputs):
        return {"OUTPUT0": inputs["INPUT0"] * 2 + 1}
'''


def make_repo(repo: str) -> None:
    import make_models

    make_models.make_tiny(repo)
    for name, py in (("hop", HOP_PY), ("local", LOCAL_PY)):
        os.makedirs(f"{repo}/{name}/1")
        with open(f"{repo}/{name}/1/model.py", "w") as f:
            f.write(textwrap.dedent(py).lstrip())
        with open(f"{repo}/{name}/config.pbtxt", "w") as f:
            f.write(textwrap.dedent(f"""
                backend: "python"
                max_batch_size: 8
                input [ {{ name: "INPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
                output [ {{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ {WIDTH} ] }} ]
                dynamic_batching {{ }}
            """).lstrip())


def level(client, model: str, concurrency: int, seconds: float) -> tuple[float, float, float]:
    """(p50 ms, p99 ms, requests/s) of ``concurrency`` threads each sending one request after another."""
    x = np.ones((1, WIDTH), np.float32)
    client.infer(model, {"INPUT0": x})
    latencies: list[float] = []
    lock = threading.Lock()
    stop = time.monotonic() + seconds

    def run() -> None:
        mine = []
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            client.infer(model, {"INPUT0": x})
            mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    q = statistics.quantiles(latencies, n=100)
    return q[49] * 1e3, q[98] * 1e3, len(latencies) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="per model and concurrency level")
    parser.add_argument("--concurrency", default="1,16")
    args = parser.parse_args()
    from gepool import Pool

    with tempfile.TemporaryDirectory() as repo:
        make_repo(repo)
        with Pool(repo) as pool:
            client = pool.client()
            print(f"{'model':8} {'conc':>4} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8}")
            for concurrency in (int(c) for c in args.concurrency.split(",")):
                rows = {m: level(client, m, concurrency, args.seconds) for m in ("tiny", "local", "hop")}
                for m, (p50, p99, rate) in rows.items():
                    print(f"{m:8} {concurrency:4} {p50:8.3f} {p99:8.3f} {rate:8.0f}")
                hop = rows["hop"][0] - rows["local"][0]
                print(f"BLS hop at concurrency {concurrency}: p50 {hop:.3f} ms over the python model alone; "
                      f"a client round trip to tiny: p50 {rows['tiny'][0]:.3f} ms")


if __name__ == "__main__":
    main()
