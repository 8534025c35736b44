"""Mixed load with periodic worker kills; every request must be answered (benchmarks/README.md)."""

import argparse
import collections
import os
import random
import signal
import sys
import tempfile
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

REQUEST_TIMEOUT_S = 60.0


def front_figures(pid: int) -> tuple[int, int]:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    with open(f"/proc/{pid}/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS"))
    return fds, rss


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--kill-every", type=float, default=5)
    parser.add_argument("--clients", type=int, default=4)
    args = parser.parse_args()

    import make_models

    from gepool import Pool
    from gepool.common import errors
    from gepool.ipc import naming
    from tests import repo as test_repo

    repo = tempfile.mkdtemp(prefix="gepool-soak-")
    make_models.make_all(repo)
    test_repo.recorder(repo, "pair", count=2, max_batch=8, preferred="8", delay_us=2000,
                       extra='parameters { key: "sleep_ms" value: { string_value: "2" } }')
    inputs = {"tiny": ("INPUT0", 16), "mlp": ("INPUT", 1024), "postprocess": ("LOGITS", 1000), "pair": ("INPUT", 4)}
    counts: collections.Counter = collections.Counter()
    lock = threading.Lock()
    stop = threading.Event()

    def note(key: str) -> None:
        with lock:
            counts[key] += 1

    with Pool(repo) as pool:
        status = pool.client().status()  # this client stays open for the whole run, like the watcher below
        front = status["pid"]
        seg0, (fd0, rss0) = len(naming.list_segments()), front_figures(front)

        def load(i: int) -> None:
            rng = random.Random(i)
            with pool.client(shared_memory=i % 2 == 1, arena_min_bytes=0, timeout=REQUEST_TIMEOUT_S) as c:
                while not stop.is_set():
                    model = rng.choice(["tiny", "tiny", "pair", "pair", "postprocess", "mlp"])
                    name, width = inputs[model]
                    rows = rng.randint(1, 4)
                    x = np.full((rows, width), rng.randint(0, 100), np.float32)
                    futures = [c.infer_async(model, {name: x}) for _ in range(rng.randint(1, 8))]
                    for _ in futures:
                        note("sent")
                    for f in futures:
                        try:
                            f.result(timeout=REQUEST_TIMEOUT_S + 5)
                            note("ok")
                        except errors.GepoolError as exc:
                            note(exc.code)
                        except Exception as exc:  # a future that never resolved: lost
                            note(f"lost:{type(exc).__name__}")

        watcher = pool.client()

        def killer() -> None:
            rng = random.Random(99)
            while not stop.wait(args.kill_every):
                pids = [p for m in watcher.status()["models"].values() for p in m["worker_pids"]]
                if pids:
                    os.kill(rng.choice(pids), signal.SIGKILL)
                    note("kills")

        threads = [threading.Thread(target=load, args=(i,)) for i in range(args.clients)]
        threads.append(threading.Thread(target=killer))
        start = time.monotonic()
        for t in threads:
            t.start()
        while time.monotonic() - start < args.duration:
            time.sleep(min(30, args.duration))
            print(f"  t={time.monotonic() - start:5.0f}s {dict(counts)}", flush=True)
        stop.set()
        for t in threads:
            t.join()
        time.sleep(2)  # restarts settle
        end_status = watcher.status()
        seg1, (fd1, rss1) = len(naming.list_segments()), front_figures(front)

    answered = sum(v for k, v in counts.items() if k not in ("sent", "kills") and not k.startswith("lost"))
    lost = counts["sent"] - answered
    print(f"duration {args.duration:.0f}s, {args.clients} clients, a worker killed every {args.kill_every}s "
          f"({counts['kills']} kills)")
    print(f"sent {counts['sent']}, answered {answered}, ok {counts['ok']}, "
          f"failed {({k: v for k, v in counts.items() if k not in ('sent', 'ok', 'kills')})}, lost {lost}")
    print(f"segments in /dev/shm: {seg0} -> {seg1}; front fds: {fd0} -> {fd1}; front RSS: {rss0} -> {rss1} kB")
    print("models at the end: " + ", ".join(f"{n}={m['state']}({m['ready_workers']}/{m['workers']})"
                                            for n, m in end_status["models"].items()))
    print(f"after the pool stopped: {len(naming.list_segments())} gepool segments in /dev/shm")


if __name__ == "__main__":
    main()
