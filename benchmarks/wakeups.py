"""How much of the latency at concurrency 1 is waking processes on other cores (benchmarks/README.md)."""

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def pin(pid: int, cpus: set[int]) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), cpus)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import core

    from gepool import Pool

    everywhere = set(range(os.cpu_count() or 1))
    floor = core.zmq_floor(args.requests)
    print(f"pyzmq REQ/REP round trip (floor), spread over the cores: p50 {np.median(floor) * 1e6:.0f} us")
    os.sched_setaffinity(0, {0})  # the echo process and every ZMQ thread inherit it
    try:
        pinned_floor = np.median(core.zmq_floor(args.requests))
    finally:
        os.sched_setaffinity(0, everywhere)
    print(f"pyzmq REQ/REP round trip (floor), pinned to one core:    p50 {pinned_floor * 1e6:.0f} us")
    with Pool(core.example_repo("gepool-wakeups-")) as pool:
        client = pool.client()
        pids = [os.getpid(), pool.process.pid, *client.status()["models"]["tiny"]["worker_pids"]]
        core.tiny_latency(client, 300)
        try:
            for r in range(args.rounds):
                for label, cpus in (("spread over the cores", everywhere), ("pinned to one core", {0})):
                    for pid in pids:
                        pin(pid, cpus)
                    p50 = np.median(core.tiny_latency(client, args.requests))
                    print(f"round {r + 1}, {label:<22} tiny c=1 p50 {p50 * 1e6:5.0f} us  "
                          f"{p50 / np.median(floor):.2f}x floor", flush=True)
        finally:
            for pid in pids:
                pin(pid, everywhere)


if __name__ == "__main__":
    main()
