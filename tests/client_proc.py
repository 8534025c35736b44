"""A client in its own process: N requests in flight on 'tiny', each checked against its own input.

    python tests/client_proc.py ENDPOINT N SEED SHARED(0|1)   -> prints 'ok N' or 'mismatch ...'
"""

import sys

import numpy as np

from gepool import Client


def main(endpoint: str, n: int, seed: int, shared: bool) -> int:
    with Client(endpoint, shared_memory=shared, arena_min_bytes=0) as c:
        xs = [np.full((1 + i % 3, 16), seed * 100_000 + i, np.float32) for i in range(n)]
        futures = [c.infer_async("tiny", {"INPUT0": x}) for x in xs]
        for x, fut in zip(xs, futures):
            got = fut.result(timeout=120)["OUTPUT0"]
            if got.shape != x.shape or not np.array_equal(got, 2 * x + 1):
                print(f"mismatch for input {x[0, 0]}: got {got[:, 0]}")
                return 1
    print(f"ok {n}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"))
