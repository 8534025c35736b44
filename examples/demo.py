"""Starts `gepool start` on the example repository, runs examples/client.py against it (frames, then
shared memory), runs the classify ensemble (preprocess -> mlp -> topk inside the pool), sends one request
over the KServe v2 HTTP protocol, shows a few metrics, and stops it.

    python examples/demo.py      (run examples/make_models.py first)
"""

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    repo = os.path.join(HERE, "models")
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='gepool-demo-')}/gepool.sock"
    http_port, metrics_port, grpc_port = _free_port(), _free_port(), _free_port()
    server = subprocess.Popen([sys.executable, "-m", "gepool.cli", "start", "--model-repository", repo,
                               "--endpoint", endpoint, "--log-level", "WARNING", "--http-port", str(http_port),
                               "--metrics-port", str(metrics_port), "--grpc-port", str(grpc_port)],
                              stdout=subprocess.PIPE, text=True)
    try:
        for line in server.stdout:
            print(f"[gepool start] {line.rstrip()}")
            if line.startswith("gepool ready"):
                break
        else:
            return server.wait() or 1
        for extra in ([], ["--shared-memory"]):
            print(f"\n$ python examples/client.py --endpoint {endpoint} {' '.join(extra)}")
            client = [sys.executable, os.path.join(HERE, "client.py"), "--endpoint", endpoint, *extra]
            subprocess.run(client, check=True)
        _ensemble(endpoint)
        _http(http_port, metrics_port)
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(60)
        print(f"\n[gepool start] stopped with exit code {code}")
    return code


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ensemble(endpoint: str) -> None:
    import numpy as np

    from gepool import Client

    print("\n$ classify (an ensemble: preprocess -> mlp -> topk, each step batched inside the pool)")
    with Client(endpoint, timeout=60) as client:
        images = np.random.default_rng(0).random((2, 1024), dtype=np.float32) * 255
        out = client.infer("classify", {"IMAGE": images})
        for i, (classes, scores) in enumerate(zip(out["CLASSES"], out["SCORES"])):
            best = ", ".join(f"{c} ({s:.3f})" for c, s in zip(classes, scores))
            print(f"image {i}: top classes {best}")
        stats = client.stats()
        steps = ", ".join(f"{m} {stats[m]['requests']}" for m in ("preprocess", "mlp", "topk"))
        print(f"requests: classify {stats['classify']['requests']}; its steps {steps}")


def _http(http_port: int, metrics_port: int) -> None:
    body = {"inputs": [{"name": "INPUT0", "shape": [1, 16], "datatype": "FP32", "data": list(range(16))}]}
    print(f"\n$ curl -X POST localhost:{http_port}/v2/models/tiny/infer -d '{json.dumps(body)[:60]}...'")
    req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v2/models/tiny/infer", json.dumps(body).encode())
    print(urllib.request.urlopen(req, timeout=30).read().decode()[:200])
    print(f"\n$ curl localhost:{metrics_port}/metrics | grep nv_inference_request_success")
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=30).read().decode()
    print("\n".join(line for line in text.splitlines() if line.startswith("nv_inference_request_success")))


if __name__ == "__main__":
    sys.exit(main())
