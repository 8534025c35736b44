"""kserve's parse and encode against the previous implementation (tests/kserve_prev.py), in one process.

    python benchmarks/kserve_ab.py [--seconds 2]

tiny (1x16) and MLP (1x1024 in, 1x1000 out) FP32 bodies, flat and nested, and INT64; the two modules
alternate in chunks of calls, so load on a shared host falls on both alike. Figures: this thread's CPU
microseconds per call, the minimum and the median over the chunks.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gepool.http import kserve  # noqa: E402
from tests import kserve_prev as prev  # noqa: E402


def chunk(fn, args: tuple, n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        fn(*args)
    return (time.thread_time() - start) / n * 1e6


def cases() -> list[tuple[str, str, object]]:
    out = []
    for model, width, answer in (("tiny", 16, 16), ("mlp", 1024, 1000)):
        x = np.random.default_rng(0).standard_normal(width).astype(np.float32)
        y = np.random.default_rng(1).standard_normal((1, answer)).astype(np.float32)
        for label, data in (("flat", x.tolist()), ("nested", [x.tolist()]), ("int64", list(range(width)))):
            body = json.dumps({"inputs": [{"name": "X", "datatype": "INT64" if label == "int64" else "FP32",
                                           "shape": [1, width], "data": data}]}).encode()
            out.append((model, f"parse {label}", lambda m, body=body: (m.parse_request, (body, None))))
        out.append((model, "encode", lambda m, y=y: (m.encode_response,
                                                     ("m", "1", m.InferRequest({}, None, False), {"OUT": y}))))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=2.0, help="per case, both modules together")
    args = parser.parse_args()
    for model, label, make in cases():
        (f_prev, a_prev), (f_new, a_new) = make(prev), make(kserve)
        n = 200 if model == "tiny" else 20
        old, new = [], []
        stop_at = time.monotonic() + args.seconds
        while time.monotonic() < stop_at:
            pair = [(old, f_prev, a_prev), (new, f_new, a_new)]
            for into, fn, fargs in pair if len(old) % 2 else pair[::-1]:
                into.append(chunk(fn, fargs, n))
        print(f"{model:5s} {label:13s} prev min {min(old):6.1f} med {statistics.median(old):6.1f}   new min "
              f"{min(new):6.1f} med {statistics.median(new):6.1f} us   ({min(new) / min(old) - 1:+.0%} min, "
              f"{statistics.median(new) / statistics.median(old) - 1:+.0%} median; {len(old)} chunks of {n})",
              flush=True)


if __name__ == "__main__":
    main()
