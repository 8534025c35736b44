"""The library client against a running pool: one request per example model, then a burst of many.

    python examples/client.py [--endpoint ipc://...] [--shared-memory]
"""

import argparse
import time

import numpy as np

from gepool import Client


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--endpoint", help="the pool's endpoint (default: gepool's default ipc path)")
    parser.add_argument("--shared-memory", action="store_true", help="carry tensors through a shared-memory arena")
    args = parser.parse_args()
    rng = np.random.default_rng(0)

    with Client(args.endpoint, shared_memory=args.shared_memory) as client:
        for name, m in client.status()["models"].items():
            print(f"{name:12s} {m['state']}")

        x = rng.standard_normal((2, 16)).astype(np.float32)
        y = client.infer("tiny", {"INPUT0": x})["OUTPUT0"]
        print(f"tiny: 2x+1 correct = {np.allclose(y, 2 * x + 1)}")

        features = rng.standard_normal((4, 1024)).astype(np.float32)
        logits = client.infer("mlp", {"INPUT": features})["LOGITS"]
        top = client.infer("postprocess", {"LOGITS": logits})
        print(f"mlp -> postprocess: classes {top['CLASS'][:, 0].tolist()}, "
              f"max probability {', '.join(f'{p:.4f}' for p in top['PROBS'].max(axis=1))}")

        n = 256
        start = time.perf_counter()
        futures = [client.infer_async("mlp", {"INPUT": features[i % 4:i % 4 + 1]}) for i in range(n)]
        for i, fut in enumerate(futures):
            assert np.allclose(fut.result()["LOGITS"], logits[i % 4:i % 4 + 1], atol=1e-4)
        elapsed = time.perf_counter() - start
        stats = client.stats()["mlp"]
        print(f"mlp: {n} concurrent requests answered correctly in {elapsed:.2f}s ({n / elapsed:.0f} req/s); "
              f"batch sizes so far {stats['batch_sizes']}")


if __name__ == "__main__":
    main()
