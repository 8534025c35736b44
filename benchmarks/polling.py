"""What the front's polling buys and costs at concurrency 1 (method: benchmarks/README.md)."""

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

PATTERNS = (("back to back", 0.0), ("1 ms gaps", 0.001), ("10 ms gaps", 0.01))


def run_pattern(client, pids: list[int], gap: float, n: int) -> tuple[np.ndarray, list[float]]:
    from core import cpu_seconds

    x = np.ones((1, 16), np.float32)
    before = [cpu_seconds(p) for p in pids]
    times = []
    for _ in range(n):
        t = time.perf_counter()
        client.infer("tiny", {"INPUT0": x})
        times.append(time.perf_counter() - t)
        if gap:
            time.sleep(gap)
    return np.array(times), [(cpu_seconds(p) - b) / n for p, b in zip(pids, before)]


def mixed(repo: str, mode: int, seconds: float) -> str:
    import threading

    from gepool import Pool

    jobs = [("tiny", "INPUT0", 16), ("tiny", "INPUT0", 16), ("mlp", "INPUT", 1024), ("tiny", "INPUT0", 16)]
    with Pool(repo, busy_poll_us=mode) as pool:
        clients = [pool.client() for _ in jobs]
        results: dict[int, tuple] = {}
        stop = time.perf_counter() + seconds

        def work(i: int) -> None:
            model, name, width = jobs[i]
            x = np.ones((1, width), np.float32)
            clients[i].infer(model, {name: x})
            times = []
            while time.perf_counter() < stop:
                t = time.perf_counter()
                clients[i].infer(model, {name: x})
                times.append(time.perf_counter() - t)
            results[i] = (model, len(times), np.median(times) * 1e6)

        threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return "  ".join(f"{m} {n} req p50 {p:.0f} us" for m, n, p in (results[i] for i in range(len(jobs))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--modes", default="0,-1,200", help="busy_poll_us values to compare")
    parser.add_argument("--mixed", action="store_true", help="three tiny clients beside an MLP client")
    args = parser.parse_args()

    import core

    from gepool import Pool

    repo = core.example_repo("gepool-polling-")
    modes = [int(m) for m in args.modes.split(",")]
    if args.mixed:
        print("three sequential tiny clients and one sequential MLP client, 6 s")
        for _ in range(args.rounds):
            for mode in modes:
                print(f"busy_poll_us {mode:>4}: {mixed(repo, mode, 6.0)}")
        return
    print(f"tiny model, concurrency 1, {args.requests} requests per pattern (gapped: a quarter as many)")
    print(f"{'busy_poll_us':>12}  {'pattern':<13} {'p50 us':>7} {'p99 us':>7} {'front us/req':>13} "
          f"{'worker us/req':>14}  polling")
    for _ in range(args.rounds):
        for mode in modes:
            with Pool(repo, busy_poll_us=mode) as pool:
                client = pool.client()
                status = client.status()
                pids = [pool.process.pid, status["models"]["tiny"]["worker_pids"][0]]
                run_pattern(client, pids, 0.0, 300)
                for name, gap in PATTERNS:
                    n = args.requests if not gap else max(50, args.requests // 4)
                    times, cpu = run_pattern(client, pids, gap, n)
                    polling = client.status()["polling"]
                    print(f"{mode:>12}  {name:<13} {np.median(times) * 1e6:7.0f} {np.percentile(times, 99) * 1e6:7.0f} "
                          f"{cpu[0] * 1e6:13.0f} {cpu[1] * 1e6:14.0f}  {polling['mode']}, window "
                          f"{polling['window_us']:.0f} us, {polling['empty_windows']}/{polling['windows']} empty")


if __name__ == "__main__":
    main()
