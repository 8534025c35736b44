"""The transport floor, tiny-model latency and MLP throughput beside the limit (method: benchmarks/README.md)."""

import argparse
import multiprocessing
import os
import sys
import tempfile
import threading
import time

import numpy as np
import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def _echo(endpoint: str, n: int) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    sock.bind(endpoint)
    for _ in range(n):
        sock.send(sock.recv())
    sock.close()
    ctx.term()


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process (every thread), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def example_repo(prefix: str) -> str:
    """A fresh temporary repository holding the tiny and MLP example models."""
    import make_models

    repo = tempfile.mkdtemp(prefix=prefix)
    make_models.make_tiny(repo)
    make_models.make_mlp(repo)
    return repo


def zmq_floor(n: int) -> np.ndarray:
    endpoint = f"ipc://{tempfile.mkdtemp()}/echo.sock"
    proc = multiprocessing.get_context("spawn").Process(target=_echo, args=(endpoint, n + 100))
    proc.start()
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.connect(endpoint)
    payload = b"x" * 64
    times = []
    for i in range(n + 100):
        t = time.perf_counter()
        sock.send(payload)
        sock.recv()
        if i >= 100:
            times.append(time.perf_counter() - t)
    sock.close()
    ctx.term()
    proc.join()
    return np.array(times)


def ort_rates(model_path: str, threads: int, seconds: float, sizes: tuple[int, ...] = (1, 8, 16, 32),
              rounds: int = 3) -> dict[int, tuple[float, float]]:
    """onnxruntime in-process per batch size: (rows/s, CPU seconds per row). The sizes take turns over
    ``rounds`` rounds and each keeps its median: this host drifts by 15% within seconds, and the ratio
    of two sizes (batch 16 against the best) should compare neighbouring moments."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
    inputs = {bs: np.random.default_rng(0).standard_normal((bs, 1024)).astype(np.float32) for bs in sizes}
    seen: dict[int, list[tuple[float, float]]] = {bs: [] for bs in sizes}
    for _ in range(rounds):
        for bs, x in inputs.items():
            sess.run(None, {"INPUT": x})
            rows, start, cpu = 0, time.perf_counter(), cpu_seconds(os.getpid())
            while time.perf_counter() - start < seconds / len(sizes) / rounds:
                sess.run(None, {"INPUT": x})
                rows += bs
            seen[bs].append((rows / (time.perf_counter() - start), (cpu_seconds(os.getpid()) - cpu) / rows))
    rates = {bs: (float(np.median([r for r, _ in v])), float(np.median([c for _, c in v]))) for bs, v in seen.items()}
    for bs, (rate, cpu) in rates.items():
        print(f"   onnxruntime in-process, batch {bs:2d}: {rate:8.0f} rows/s, {cpu * 1e6:5.0f} us CPU per row")
    return rates


def ort_limit(model_path: str, threads: int, seconds: float) -> tuple[int, float, dict[int, tuple[float, float]]]:
    """(best batch size, its rows/s, ort_rates' figures per batch size)."""
    rates = ort_rates(model_path, threads, seconds)
    best = max(rates, key=lambda bs: rates[bs][0])
    return best, rates[best][0], rates


def serving_cpu(pool, run) -> tuple[object, dict[str, float]]:
    """``run()``'s result, and the CPU seconds the front and this (client) process spent while it ran:
    on a host whose cores onnxruntime fills, every one of them is taken from compute."""
    front, mine = cpu_seconds(pool.process.pid), cpu_seconds(os.getpid())
    result = run()
    return result, {"front": cpu_seconds(pool.process.pid) - front, "client": cpu_seconds(os.getpid()) - mine}


def tiny_latency(client, n: int) -> np.ndarray:
    x = np.ones((1, 16), np.float32)
    for _ in range(100):
        client.infer("tiny", {"INPUT0": x})
    times = []
    for _ in range(n):
        t = time.perf_counter()
        client.infer("tiny", {"INPUT0": x})
        times.append(time.perf_counter() - t)
    return np.array(times)


def mlp_throughput(client, concurrency: int, seconds: float) -> float:
    """Closed loop: each answer sends the next request from the client's I/O thread, so the load
    generator costs one thread and no GIL hand-offs between sixteen callers."""
    x = np.random.default_rng(1).standard_normal((1, 1024)).astype(np.float32)
    client.infer("mlp", {"INPUT": x})
    lock, done, finished = threading.Lock(), [0], threading.Event()
    in_flight = [concurrency]
    stop = time.perf_counter() + seconds

    def on_done(fut) -> None:
        fut.result()
        with lock:
            done[0] += 1
            if time.perf_counter() < stop:
                client.infer_async("mlp", {"INPUT": x}).add_done_callback(on_done)
                return
            in_flight[0] -= 1
            if in_flight[0] == 0:
                finished.set()

    start = time.perf_counter()
    for _ in range(concurrency):
        client.infer_async("mlp", {"INPUT": x}).add_done_callback(on_done)
    finished.wait()
    return done[0] / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()

    from gepool import Pool

    repo = example_repo("gepool-bench-")
    cores = os.cpu_count() or 1
    print(f"host: {cores} cores; onnxruntime spinning off everywhere")

    print("1. bare pyzmq REQ/REP round trip over ipc")
    floor = zmq_floor(args.requests)
    print(f"   p50 {np.median(floor) * 1e6:7.1f} us   p99 {np.percentile(floor, 99) * 1e6:7.1f} us")

    print("3a. onnxruntime in-process (the limit), MLP 1024-4096-4096-1000")
    worker_threads = len(os.sched_getaffinity(0))  # what the pool gives its one MLP instance
    best_bs, best_rate, rates = ort_limit(f"{repo}/mlp/1/model.onnx", worker_threads, args.seconds)

    with Pool(repo) as pool:
        client = pool.client()
        print("2. gepool, tiny model, concurrency 1")
        lat = tiny_latency(client, args.requests)
        p50, p99 = np.median(lat) * 1e6, np.percentile(lat, 99) * 1e6
        print(f"   p50 {p50:7.1f} us   p99 {p99:7.1f} us")
        print("3b. gepool, MLP, concurrency 16")
        rate = mlp_throughput(client, 16, args.seconds)
        print(f"   {rate:8.0f} rows/s; batch sizes {client.stats()['mlp']['batch_sizes']}")

    print("\nratios (same run)")
    print(f"   tiny p50 / zmq round trip      = {p50 / (np.median(floor) * 1e6):5.2f}   (target <= 3)")
    print(f"   MLP gepool / onnxruntime best  = {rate / best_rate:5.2f}   (target >= 0.85; "
          f"best in-process batch {best_bs}, {worker_threads} thread(s))")
    print(f"   in-process batch 16 / best     = {rates[16][0] / best_rate:5.2f}   (the most any server reaches at "
          f"concurrency 16: sixteen requests form no larger batch)")
    print(f"   MLP gepool / in-process b. 16  = {rate / rates[16][0]:5.2f}   (what gepool's own overhead leaves)")


if __name__ == "__main__":
    main()
