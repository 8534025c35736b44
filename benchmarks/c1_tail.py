"""Sequential clients' tail: one wrk connection to gepool polling adaptively, to gepool never polling, and to Mosec.

    python benchmarks/c1_tail.py [--rounds 3] [--seconds 8] [--model tiny] [--threads 2]

At concurrency 1 the batcher's 1 ms wait and the wake-ups around it are most of a request's time, and the p99
moves from run to run by more than it differs between servers (benchmarks/README.md). This alternates the three
in rounds on one host (gepool's two pools started afresh each round, ``busy_poll_us`` 0 and -1; Mosec started
once), each with the same JSON row and batching (``peers.matched_repo``), and prints each round's req/s, p50
and p99, then each gepool's median p99 against Mosec's.
"""

import argparse
import os
import shutil
import statistics
import sys

import http_peers
import loadgen
import peers

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

POLLS = {"gepool adaptive": 0, "gepool never polls": -1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0, help="per server and round")
    parser.add_argument("--model", default="tiny", choices=sorted(http_peers.MODELS))
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="onnxruntime threads, both servers")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("c1_tail.py needs wrk (apt-get install wrk)")

    from gepool import Pool

    repo = peers.matched_repo("gepool-c1-tail-")
    rows: dict[str, list[dict]] = {name: [] for name in (*POLLS, "mosec")}
    stop = None
    try:
        body, _, want = http_peers.body_for(repo, args.model)
        try:
            mosec_port, stop = peers.start_mosec(repo, threads=args.threads)
            http_peers.check_answer(f"http://127.0.0.1:{mosec_port}/v2/models/{args.model}/infer", body, want)
        except (peers.PeerUnavailable, OSError) as exc:
            print(f"mosec left out: {exc}")
        for n in range(args.rounds):
            for name, poll in POLLS.items():
                port = peers.free_port()
                with Pool(repo, http_port=port, grpc_port=0, cpu_threads=args.threads, busy_poll_us=poll):
                    url = f"http://127.0.0.1:{port}/v2/models/{args.model}/infer"
                    http_peers.check_answer(url, body, want)
                    rows[name].append(loadgen.wrk(url, body, 1, args.seconds))
            if stop is not None:
                rows["mosec"].append(loadgen.wrk(f"http://127.0.0.1:{mosec_port}/v2/models/{args.model}/infer",
                                                 body, 1, args.seconds))
            for name, results in rows.items():
                r = results[-1] if results else None
                if r is not None:
                    print(f"round {n + 1} {name:20s} {r['rps']:8.0f} req/s  p50 {r['p50_ms']:6.2f}  "
                          f"p99 {r['p99_ms']:6.2f} ms", flush=True)
    finally:
        if stop is not None:
            stop()
        shutil.rmtree(repo, ignore_errors=True)
    p99 = {name: statistics.median(r["p99_ms"] for r in results if r is not None)
           for name, results in rows.items() if any(r is not None for r in results)}
    print(f"\n{args.model} c=1, median p99 over {args.rounds} rounds: "
          + ", ".join(f"{name} {value:.2f} ms" for name, value in p99.items()))
    if "mosec" in p99:
        for name in POLLS:
            if name in p99:
                print(f"{name} against mosec: p99 {p99[name] / p99['mosec']:.2f}x")


if __name__ == "__main__":
    main()
