"""The classify ensemble (preprocess -> mlp -> topk, scheduled in the front) against the same three calls
made one after another by a client, over the library client and HTTP, at each concurrency.

    python benchmarks/ensemble_bench.py --seconds 10 [--concurrency 1 16] [--carriers library http] [--baseline REV]

For each carrier and concurrency it prints throughput (requests/s of one image each), latency p50/p99,
and for the ensemble its per-step overhead: mean ensemble latency minus the mean of its steps' compute
(the front's stats, summed over the steps each request ran in), divided by the number of steps. The
steps alone (each model called directly at the highest concurrency) give the slowest step's own
throughput, which the ensemble's is compared with.

Every measurement also reads the CPU (utime+stime, all threads, from /proc/PID/stat) of each process
when the clock starts and once the last answer is in: the front, each worker (by its model), the HTTP
sidecar, and this client process, printed as CPU microseconds per request. Their sum gives the CPU
ceiling, cores (``os.sched_getaffinity``) / CPU per request: the req/s a CPU-bound run could reach.
For the ensemble at the highest concurrency the last lines set its req/s against mlp alone's next to
the ratio of the two ceilings: what the ceilings' ratio loses is CPU the ensemble's requests cost
beyond mlp's (the other steps' own, the front's per step), what the measured ratio loses beyond that is
not CPU (waits, batching). A JSON line per measurement follows the tables.

``--baseline REV`` runs a second pool from that git revision beside this tree's (started by that tree's
own ``Pool`` in an interpreter of its own), each measurement taken on both in turn (which goes first
alternates), so that a change is compared under the same load.

``--pairs N`` measures only the goal's ratio, which one ensemble run against one later mlp run cannot
settle on a host whose speed drifts: N pairs of the ensemble and mlp alone (the slowest step), library
client at the highest concurrency, taken back to back in ABBA order, each pair's ratio and the median
of the N, with both sides' CPU per request and ceilings.
"""

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path[:0] = [os.path.join(ROOT, "examples"), HERE]

import pool_cpu  # noqa: E402

WIDTH, STEPS = 1024, ("preprocess", "mlp", "topk")
BASELINE_STOP_S = 120.0
PACKAGES = {"ipc": "ipc", "scheduler": "scheduler", "workers": "workers"}  # setup.cfg's package_dir


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def export(rev: str, into: str) -> str:
    """The gepool package of ``rev`` laid out as installed (gepool/ with ipc, scheduler and workers in it)."""
    src = os.path.join(into, "src")
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    site = os.path.join(into, "site")
    shutil.copytree(os.path.join(src, "gepool"), os.path.join(site, "gepool"))
    for sub, folder in PACKAGES.items():
        shutil.copytree(os.path.join(src, folder), os.path.join(site, "gepool", sub))
    return site


BASELINE_POOL = """
import json, sys
from gepool import Pool
pool = Pool(sys.argv[1], **json.loads(sys.argv[2])).start()
print(json.dumps({"endpoint": pool.endpoint}), flush=True)
sys.stdin.read()  # until the benchmark closes its end of the pipe, or dies
pool.stop()
"""


@dataclass
class Running:
    endpoint: str


@contextlib.contextmanager
def pool_of(repo: str, site: str | None, **kwargs):
    """A running pool (``.endpoint``) of this tree (``site`` None) or of the tree exported to ``site``: that
    one is started by its own ``Pool`` in an interpreter of its own (this tree's options may carry fields
    an older front cannot decode), and stopped when this context closes its standard input."""
    if site is None:
        from gepool import Pool

        pool = Pool(repo, **kwargs).start()
        try:
            yield pool
        finally:
            pool.stop()
        return
    proc = subprocess.Popen([sys.executable, "-c", BASELINE_POOL, repo, json.dumps(kwargs)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=dict(os.environ, PYTHONPATH=site))
    try:
        line = proc.stdout.readline()
        if not line:
            raise SystemExit(f"the pool of {site} did not start (exit code {proc.wait()})")
        yield Running(json.loads(line)["endpoint"])
    finally:
        proc.stdin.close()
        try:
            proc.wait(BASELINE_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LibraryCalls:
    """One library client per thread."""

    def __init__(self, endpoint: str) -> None:
        from gepool import Client

        self.client = Client(endpoint, timeout=120)

    def ensemble(self, x: np.ndarray) -> np.ndarray:
        return self.client.infer("classify", {"IMAGE": x})["CLASSES"]

    def chain(self, x: np.ndarray) -> np.ndarray:
        normed = self.client.infer("preprocess", {"RAW": x})["NORMED"]
        logits = self.client.infer("mlp", {"INPUT": normed})["LOGITS"]
        return self.client.infer("topk", {"LOGITS": logits})["CLASSES"]

    def step(self, model: str, x: np.ndarray) -> None:
        name = {"preprocess": "RAW", "mlp": "INPUT", "topk": "LOGITS"}[model]
        self.client.infer(model, {name: x if model != "topk" else x[:, :1000]})

    def close(self) -> None:
        self.client.close()


class HttpCalls:
    """One tritonclient.http client per thread, binary tensors."""

    def __init__(self, url: str) -> None:
        import tritonclient.http as http

        self.http, self.client = http, http.InferenceServerClient(url, network_timeout=120)

    def _infer(self, model: str, name: str, x: np.ndarray, out: str) -> np.ndarray:
        inp = self.http.InferInput(name, list(x.shape), "FP32")
        inp.set_data_from_numpy(x, binary_data=True)
        res = self.client.infer(model, [inp], outputs=[self.http.InferRequestedOutput(out, binary_data=True)])
        return res.as_numpy(out)

    def ensemble(self, x: np.ndarray) -> np.ndarray:
        return self._infer("classify", "IMAGE", x, "CLASSES")

    def chain(self, x: np.ndarray) -> np.ndarray:
        normed = self._infer("preprocess", "RAW", x, "NORMED")
        logits = self._infer("mlp", "INPUT", normed, "LOGITS")
        return self._infer("topk", "LOGITS", logits, "CLASSES")

    def close(self) -> None:
        self.client.close()


def measure(make, call: str, concurrency: int, seconds: float, procs: dict[str, list[int]], arg=None) -> dict:
    """Closed loop: ``concurrency`` threads, each with its own client (made in its thread: tritonclient's
    HTTP client is bound to the thread that made it), connected and warm before the clock starts. The
    CPU of ``procs`` is read when the clock starts and once every thread has had its last answer."""
    x = (np.random.default_rng(0).random((1, WIDTH), dtype=np.float32) * 255)
    args = [arg, x] if arg else [x]
    lat: list[list[float]] = [[] for _ in range(concurrency)]
    errors: list[str] = []
    ready = threading.Barrier(concurrency + 1)
    done = threading.Barrier(concurrency + 1)
    stop = [0.0]

    def loop(i: int) -> None:
        c = make()
        fn = getattr(c, call)
        try:
            fn(*args)
        finally:
            ready.wait()
        ready.wait()  # the clock starts
        try:
            while time.perf_counter() < stop[0]:
                t = time.perf_counter()
                try:
                    fn(*args)
                except Exception as exc:  # counted, not fatal: the figure says how many failed
                    errors.append(str(exc))
                    continue
                lat[i].append(time.perf_counter() - t)
        finally:
            done.wait()  # the CPU window closes before any client closes
            c.close()

    threads = [threading.Thread(target=loop, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    ready.wait()
    cpu_before = pool_cpu.sample(procs)
    started = time.perf_counter()
    stop[0] = started + seconds
    ready.wait()
    done.wait()
    wall = time.perf_counter() - started
    cpu_after = pool_cpu.sample(procs)
    for t in threads:
        t.join()
    if errors:
        print(f"{call} c={concurrency}: {len(errors)} failed, first: {errors[0][:300]}", file=sys.stderr)
    flat = np.array([v for per in lat for v in per]) if any(lat) else np.array([np.nan])
    n = int(np.isfinite(flat).sum())
    return {"requests": n, "errors": len(errors), "rps": n / wall,
            "p50_us": float(np.percentile(flat, 50) * 1e6), "p99_us": float(np.percentile(flat, 99) * 1e6),
            "mean_us": float(flat.mean() * 1e6), "cpu_us": pool_cpu.per_request(cpu_before, cpu_after, n)}


def ensemble_compute(stats: dict) -> tuple[int, float]:
    """(requests, seconds of their steps' compute) the front has counted for the ensemble."""
    h = stats["classify"]["histograms"]["compute"]
    return h["count"], h["sum"]


def copies(client) -> dict:
    """The front's count of ensemble step outputs' bytes by where they went (empty from a pool without it):
    out_bytes copied out of a slot to wait (a hop's second copy), handed_bytes read slot to slot, answered_bytes
    answered from the last step's slot."""
    return client.status().get("ensemble_copies") or {}


def rows_per_batch(before: dict, after: dict) -> dict[str, float]:
    """Each step model's requests per batch over the window between two stats (its direct and step requests)."""
    out = {}
    for m in STEPS:
        batches = after[m]["batches"] - before[m]["batches"]
        if batches:
            out[m] = (after[m]["requests"] - before[m]["requests"]) / batches
    return out


def cpu_table(rows: list[dict]) -> None:
    """CPU us per request by process, their sum, and the CPU ceiling: the req/s the host's cores would
    allow if that sum were all a request cost (written into each row as ``ceiling_rps``)."""
    n = pool_cpu.cores()
    roles = ["front", *(f"worker {m}" for m in STEPS), "sidecar", pool_cpu.CLIENT]
    print(f"\nCPU us per request by process ({n} cores; 'other' = the pool's other workers; 'batch': requests per "
          f"batch of {', '.join(STEPS)})")
    print(f"{'pool':8} {'carrier':8} {'c':>3} {'mode':16} " + " ".join(f"{r.split()[-1][:10]:>10}" for r in roles)
          + f" {'other':>7} {'total':>8} {'ceiling/s':>9}  batch")
    for r in rows:
        cpu = r["cpu_us"]
        other = sum(v for k, v in cpu.items() if k not in roles)
        total = sum(cpu.values())
        r["cpu_total_us"], r["ceiling_rps"] = total, n / total * 1e6 if total else float("nan")
        print(f"{r['pool'][:8]:8} {r['carrier']:8} {r['concurrency']:>3} {r['mode']:16} "
              + " ".join(f"{cpu.get(role, float('nan')):10.0f}" for role in roles)
              + f" {other:7.0f} {total:8.0f} {r['ceiling_rps']:9.0f}  "
              + "/".join(f"{r['rows_per_batch'][m]:.1f}" if m in r["rows_per_batch"] else "-" for m in STEPS)
              + (f"  RESTARTED: {', '.join(r['restarted'])}" if r.get("restarted") else ""))


def pairs(n: int, timed) -> int:
    """``n`` back-to-back pairs of the ensemble and mlp alone (``timed(call, *model)`` measures one), ABBA."""
    ratios, ceilings, nan = [], [], float("nan")
    print(f"\n{'pair':>4} {'ensemble/s':>10} {'mlp/s':>8} {'ratio':>6}  {'CPU us ens':>10} {'CPU us mlp':>10} "
          f"{'ceiling ratio':>13}  front ens/mlp  mlp worker ens/mlp  python steps  mlp rows/batch ens/mlp")
    for i in range(n):
        got = {}
        for call in (("ensemble", "step") if i % 2 == 0 else ("step", "ensemble")):
            got[call] = timed(call, *(("mlp",) if call == "step" else ()))
        ens, mlp = got["ensemble"], got["step"]
        ratio = ens["rps"] / mlp["rps"]
        ce, cm = sum(ens["cpu_us"].values()), sum(mlp["cpu_us"].values())
        ratios.append(ratio)
        ceilings.append(cm / ce)
        print(f"{i + 1:>4} {ens['rps']:10.1f} {mlp['rps']:8.1f} {ratio:6.0%}  {ce:10.0f} {cm:10.0f} {cm / ce:13.0%}  "
              f"{ens['cpu_us']['front']:5.0f}/{mlp['cpu_us']['front']:<5.0f}   "
              f"{ens['cpu_us']['worker mlp']:5.0f}/{mlp['cpu_us']['worker mlp']:<5.0f}        "
              f"{ens['cpu_us'].get('worker preprocess', 0) + ens['cpu_us'].get('worker topk', 0):5.0f}        "
              f"{ens['rows_per_batch'].get('mlp', nan):4.1f}/{mlp['rows_per_batch'].get('mlp', nan):<4.1f}", flush=True)
        if ens["errors"] or mlp["errors"]:
            print(f"     errors: ensemble {ens['errors']}, mlp {mlp['errors']}")
    print(f"median of {n} pairs: ensemble at {statistics.median(ratios):.0%} of mlp alone (range "
          f"{min(ratios):.0%}-{max(ratios):.0%}); CPU ceiling ratio {statistics.median(ceilings):.0%}")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement (default 10)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--carriers", nargs="+", default=["library", "http"], choices=["library", "http"])
    parser.add_argument("--repository", help="a repository holding classify and its steps (default: written "
                                             "to a temporary folder by examples/make_models.py)")
    parser.add_argument("--baseline", metavar="REV", help="also measure a pool from this git revision (exported "
                                                         "to a temporary folder), alternating with this tree's")
    parser.add_argument("--pairs", type=int, metavar="N", help="only N alternating pairs of the ensemble and mlp "
                                                              "alone (library, highest concurrency) and their ratios")
    args = parser.parse_args()
    if args.pairs is not None and (args.pairs < 1 or args.baseline):
        parser.error("--pairs takes N >= 1, and not with --baseline")

    import make_models

    from gepool import Client

    work = tempfile.mkdtemp(prefix="gepool-ens-bench-")
    repo = args.repository or make_models.make_examples(os.path.join(work, "repo"))
    sites = {"this": None}
    if args.baseline:
        sites = {args.baseline: export(args.baseline, os.path.join(work, "baseline")), "this": None}
    os.chdir(work)  # a front started here imports gepool from its PYTHONPATH or the installed one, not a checkout
    rows = []
    with contextlib.ExitStack() as stack:
        pools, ports, stats, procs = {}, {}, {}, {}
        for name, site in sites.items():
            ports[name] = free_port()
            pools[name] = stack.enter_context(pool_of(repo, site, http_port=ports[name] if "http" in args.carriers
                                                      else 0))
            stats[name] = Client(pools[name].endpoint, timeout=60)
            stack.callback(stats[name].close)
            x = np.random.default_rng(1).random((3, WIDTH), dtype=np.float32)
            lib = LibraryCalls(pools[name].endpoint)
            assert np.array_equal(lib.ensemble(x), lib.chain(x)), "the ensemble and the chain disagree"
            lib.close()
            procs[name] = pool_cpu.pool_processes(stats[name].status())
            print(f"{name}: " + " ".join(f"{role}={','.join(map(str, pids))}" for role, pids in procs[name].items()),
                  flush=True)

        def maker(carrier: str, name: str):
            if carrier == "http":
                return lambda: HttpCalls(f"127.0.0.1:{ports[name]}")
            return lambda: LibraryCalls(pools[name].endpoint)

        def timed(name: str, carrier: str, c: int, call: str, *model: str) -> dict:
            """``measure`` with the pool's processes read just before, and the roles whose processes
            changed by its end named under "restarted" (their CPU figures are wrong)."""
            procs[name] = pool_cpu.pool_processes(stats[name].status())
            r = measure(maker(carrier, name), call, c, args.seconds, procs[name], *model)
            r["restarted"] = pool_cpu.changed(procs[name], pool_cpu.pool_processes(stats[name].status()))
            if r["restarted"]:
                print(f"{name} {carrier} c={c} {call} {''.join(model)}: processes changed during the measurement "
                      f"({', '.join(r['restarted'])}): their CPU figures are wrong", file=sys.stderr)
            return r

        if args.pairs:
            def paired(call: str, *model: str) -> dict:
                seen = stats["this"].stats()
                r = timed("this", "library", max(args.concurrency), call, *model)
                return {**r, "rows_per_batch": rows_per_batch(seen, stats["this"].stats())}

            code = pairs(args.pairs, paired)
            stack.close()
            shutil.rmtree(work, ignore_errors=True)
            return code
        turn = 0
        for carrier in args.carriers:
            for c in args.concurrency:
                for call in ("ensemble", "chain"):
                    order = list(sites) if turn % 2 == 0 else list(reversed(sites))  # ABBA
                    turn += 1
                    for name in order:
                        seen, copied = stats[name].stats(), copies(stats[name])
                        r = timed(name, carrier, c, call)
                        now = stats[name].stats()
                        before, after = ensemble_compute(seen), ensemble_compute(now)
                        row = {"pool": name, "carrier": carrier, "concurrency": c, "mode": call, **r,
                               "rows_per_batch": rows_per_batch(seen, now)}
                        if call == "ensemble" and copied:
                            moved = copies(stats[name])
                            row["copied_bytes_per_request"] = {k: (moved[k] - copied[k]) / max(r["requests"], 1)
                                                               for k in copied}
                        if call == "ensemble" and after[0] > before[0]:
                            compute_us = (after[1] - before[1]) / (after[0] - before[0]) * 1e6
                            row["steps_compute_us"] = compute_us
                            row["overhead_per_step_us"] = (r["mean_us"] - compute_us) / len(STEPS)
                        rows.append(row)
        top = max(args.concurrency)
        for model in STEPS:
            for name in sites:
                seen = stats[name].stats()
                r = timed(name, "library", top, "step", model)
                rows.append({"pool": name, "carrier": "library", "concurrency": top, "mode": f"{model} alone", **r,
                             "rows_per_batch": rows_per_batch(seen, stats[name].stats())})
    shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'pool':8} {'carrier':8} {'c':>3} {'mode':16} {'req/s':>8} {'p50 us':>9} {'p99 us':>9} {'steps us':>9} "
          f"{'ovh/step us':>11} {'errors':>6}")
    for r in rows:
        print(f"{r['pool'][:8]:8} {r['carrier']:8} {r['concurrency']:>3} {r['mode']:16} {r['rps']:8.1f} "
              f"{r['p50_us']:9.0f} {r['p99_us']:9.0f} {r.get('steps_compute_us', float('nan')):9.0f} "
              f"{r.get('overhead_per_step_us', float('nan')):11.0f} {r['errors']:>6}")
    cpu_table(rows)
    for r in rows:
        if r["mode"] == "ensemble" and r["concurrency"] == top:
            slowest = min((s for s in rows if s["mode"].endswith(" alone") and s["pool"] == r["pool"]),
                          key=lambda s: s["rps"])
            print(f"{r['pool']} {r['carrier']} c={top}: ensemble {r['rps']:.1f} req/s = "
                  f"{r['rps'] / slowest['rps']:.0%} of the slowest step alone ({slowest['mode']}, "
                  f"{slowest['rps']:.1f} req/s)")
            moved = r.get("copied_bytes_per_request")
            if moved:
                print("  step outputs' bytes per request: " + ", ".join(f"{k.split('_')[0]} {v:.0f}"
                                                                       for k, v in moved.items()))
            mlp = next(s for s in rows if s["mode"] == "mlp alone" and s["pool"] == r["pool"])
            print(f"  CPU ceiling ({r['ceiling_rps']:.0f} ensemble, {mlp['ceiling_rps']:.0f} mlp alone) ratio "
                  f"{r['ceiling_rps'] / mlp['ceiling_rps']:.0%}; measured ratio {r['rps'] / mlp['rps']:.0%}; "
                  f"ensemble at {r['rps'] / r['ceiling_rps']:.0%} of its ceiling, mlp alone at "
                  f"{mlp['rps'] / mlp['ceiling_rps']:.0%} of its own")
    for r in rows:
        print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
