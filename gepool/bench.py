"""``gepool bench``: closed-loop (concurrency) and open-loop (Poisson rate) load against a pool, with
latency percentiles, errors by kind and the server's own view of the same window.

The load runs on the client's I/O thread (each answer sends the next request, or a timer sends at
the next arrival), so one Python thread can keep many requests in flight. The client side counts as
saturated when the sender falls behind the asked arrival times (open loop) or the client process
used nearly a whole core (closed loop: one Python process cannot go faster than that). With
``processes="auto"`` a saturated level is run again with twice the client processes, up to the
host's cores, and the report keeps the last run and how many processes it took.
"""

import json
import math
import os
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from gepool.common import errors
from gepool.ipc import dtypes

PERCENTILES = (50, 90, 95, 99)
SATURATION_LAG = 0.1  # open loop: sending more than 10% of the run late means the client could not keep up
SATURATION_CPU = 0.9  # closed loop: a client process busy 90% of the time (of one core) is the bottleneck


@dataclass
class Level:
    mode: str  # "concurrency" or "rate"
    level: float
    seconds: float = 0.0
    sent: int = 0
    ok: int = 0
    rows: int = 0
    errors: dict = field(default_factory=dict)
    latency_ms: dict = field(default_factory=dict)  # p50 p90 p95 p99 max mean
    throughput_rps: float = 0.0
    rows_per_s: float = 0.0
    client_saturated: bool = False
    send_lag_s: float = 0.0
    client_cpu: float = 0.0  # the busiest client process's CPU seconds per second of the level
    processes: int = 1
    server: dict = field(default_factory=dict)


PROGRESS_EVERY_S = 0.5  # how often a running level reports to a live display
LATEST = 2000  # answers the live percentiles look at


def level_label(mode: str | None, value: float | None) -> str:
    """'conc 16' or 'rate 1000', as the report, the live display and the sweep name a level."""
    if mode is None:
        return "-"
    return f"{'conc' if mode == 'concurrency' else 'rate'} {value:g}"


@dataclass
class Progress:
    """A running level so far, for a live display."""
    mode: str
    level: float
    seconds: float  # the level's length
    elapsed: float
    sent: int | None  # None with several client processes: ``ok`` and ``errors`` are then the server's counts
    ok: int
    errors: int
    rps: float  # answers per second since the previous report
    p50_ms: float | None = None  # over the latest answers (this process's)
    p99_ms: float | None = None
    processes: int = 1


class Display:
    """What ``bench`` tells as it runs (the CLI prints it; the default says nothing)."""

    def tick(self, progress: Progress) -> None:
        pass

    def finished(self, level: Level, again_with: int = 0) -> None:
        """A level ended; ``again_with``: its client side was saturated and it runs again with this
        many client processes."""

    def note(self, text: str) -> None:
        """A line about what comes next (a sweep's setting)."""


class TerminalDisplay(Display):
    """Progress for a person: on a terminal, one line rewritten in place while a level runs; then, on a
    terminal or not (a log, a pipe), one line per level that stays."""

    def __init__(self, stream, live: bool | None = None) -> None:
        self.stream = stream
        self.live = stream.isatty() if live is None else live
        self.width = 0  # of the line being rewritten
        self.lock = threading.Lock()

    def tick(self, progress: Progress) -> None:
        if not self.live:
            return
        text = format_progress(progress)
        with self.lock:
            self.stream.write("\r" + text.ljust(self.width))
            self.stream.flush()
            self.width = max(self.width, len(text))

    def finished(self, level: Level, again_with: int = 0) -> None:
        label = level_label(level.mode, level.level)
        lat = level.latency_ms
        text = (f"{label:>10s}  {level.throughput_rps:.1f} req/s, p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms"
                if lat else f"{label:>10s}  no answer")
        failed = sum(level.errors.values())
        if failed:
            text += f", {failed} failed"
        if again_with:
            text += f"; the client side was saturated: again with {again_with} client processes"
        elif level.client_saturated:
            text += "; the client side was saturated"
        self.note(text)

    def note(self, text: str) -> None:
        with self.lock:
            if self.width:
                self.stream.write("\r" + " " * self.width + "\r")
                self.width = 0
            self.stream.write(text + "\n")
            self.stream.flush()


def _counts_in_order(level: Level, latencies: list[float]) -> tuple:
    """(sent, answered, failed, latest latencies) of a level another thread is running, read answered
    first and latencies last: counts only grow and a latency is recorded before its answer is counted,
    so what this returns never has more answered than sent, nor answers without a latency."""
    ok = level.ok
    failed = sum(level.errors.values())
    return level.sent, ok, failed, latencies[-LATEST:]


class _Ticker:
    """Reports a running level to a Display every PROGRESS_EVERY_S, from a thread of its own, out of
    ``counts()``: (sent or None, answered, failed, latest latencies in seconds or None)."""

    def __init__(self, display: Display | None, mode: str, value: float, seconds: float, processes: int,
                 counts) -> None:
        self.display, self.counts = display, counts
        self.mode, self.value, self.seconds, self.processes = mode, value, seconds, processes
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="gepool-bench-progress", daemon=True)

    def __enter__(self) -> "_Ticker":
        self.start = self.last_t = time.perf_counter()
        self.last_ok = 0
        if self.display is not None:
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join()

    def _loop(self) -> None:
        while not self.stop.wait(PROGRESS_EVERY_S):
            try:
                progress = self.snapshot()
            except errors.GepoolError:  # the server's counts, from a pool that stopped answering: the
                continue  # level itself reports that
            self.display.tick(progress)

    def snapshot(self) -> Progress:
        sent, ok, failed, latest = self.counts()
        now = time.perf_counter()
        rps = (ok - self.last_ok) / max(now - self.last_t, 1e-9)
        self.last_ok, self.last_t = ok, now
        p50 = p99 = None
        if latest:
            arr = np.asarray(latest) * 1000
            p50, p99 = float(np.percentile(arr, 50)), float(np.percentile(arr, 99))
        return Progress(self.mode, self.value, self.seconds, now - self.start, sent, ok, failed, rps, p50, p99,
                        self.processes)


def format_progress(p: Progress) -> str:
    label = level_label(p.mode, p.level)
    counts = (f"sent {p.sent}  ok {p.ok}  failed {p.errors}" if p.sent is not None
              else f"server answered {p.ok}  failed {p.errors}")
    lat = f"  p50 {p.p50_ms:.2f} ms  p99 {p.p99_ms:.2f} ms" if p.p50_ms is not None else ""
    procs = f"  [{p.processes} client processes]" if p.processes > 1 else ""
    return f"{label:>10s}  {min(p.elapsed, p.seconds):5.1f}/{p.seconds:g}s  {counts}  {p.rps:8.0f} req/s{lat}{procs}"


def percentiles(latencies_s: list[float]) -> dict:
    if not latencies_s:
        return {}
    arr = np.asarray(latencies_s) * 1000
    out = {f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}
    out["max"], out["mean"] = float(arr.max()), float(arr.mean())
    return out


def poisson_arrivals(rate: float, seconds: float, seed: int = 0) -> np.ndarray:
    """Arrival times (from 0) of a Poisson process of the given rate over ``seconds``."""
    rng = np.random.default_rng(seed)
    n = int(rate * seconds * 1.2) + 16
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    while times[-1] < seconds:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, n))])
    return times[times < seconds]


def make_inputs(meta: dict, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of the model's shapes (variable dims become 1), with batch_size rows when it batches."""
    rng = np.random.default_rng(seed)
    out = {}
    for t in meta["inputs"]:
        shape = [batch_size if i == 0 and meta.get("max_batch_size", 0) > 0 else (d if d > 0 else 1)
                 for i, d in enumerate(t["shape"])]
        if t["datatype"] == dtypes.BYTES:
            out[t["name"]] = np.full(shape, b"gepool", dtype=object)
        else:
            out[t["name"]] = (rng.random(shape) * 10).astype(dtypes.to_numpy(t["datatype"]))
    return out


def request_rows(inputs: dict[str, np.ndarray], batched: bool) -> int:
    """Rows one request carries: the first input's batch dimension for a batching model, else 1."""
    first = next(iter(inputs.values()))
    return (first.shape[0] if first.ndim else 1) if batched else 1


def server_window(before: dict, after: dict) -> dict:
    """What the pool saw between two stats snapshots of one model."""
    batches = after["batches"] - before["batches"]
    reqs = after["requests"] - before["requests"]
    sizes = {int(k): v - before["batch_sizes"].get(k, before["batch_sizes"].get(str(k), 0))
             for k, v in after["batch_sizes"].items()}
    return {"requests": reqs, "batches": batches,
            "avg_batch_size": (after["rows"] - before["rows"]) / batches if batches else 0.0,
            "queue_ms_avg": (after["queue_us"] - before["queue_us"]) / 1000 / max(reqs, 1),
            "compute_ms_avg": (after["compute_us"] - before["compute_us"]) / 1000 / max(batches, 1),
            "batch_sizes": {k: v for k, v in sorted(sizes.items()) if v}}


class _Run:
    """Bookkeeping shared by the I/O-thread callbacks of one level."""

    def __init__(self, client, model: str, inputs: dict, rows: int, level: Level) -> None:
        self.client, self.model, self.inputs, self.rows, self.level = client, model, inputs, rows, level
        self.lock = threading.Lock()
        self.latencies: list[float] = []
        self.outstanding = 0
        self.closing = False  # no more sends will start: the level ends when the last answer is in
        self.idle = threading.Event()

    def send(self, then=None) -> None:
        start = time.perf_counter()
        with self.lock:
            self.level.sent += 1
            self.outstanding += 1
            self.idle.clear()
        fut = self.client.infer_async(self.model, self.inputs)
        fut.add_done_callback(lambda f: self._done(f, start, then))

    def _done(self, fut, start: float, then) -> None:
        elapsed = time.perf_counter() - start
        try:
            fut.result()
            ok, kind = True, None
        except errors.GepoolError as exc:
            ok, kind = False, exc.code
        with self.lock:
            if ok:  # the latency before the count: a progress reader that sees the count sees it
                self.latencies.append(elapsed)
                self.level.ok += 1
                self.level.rows += self.rows
            else:
                self.level.errors[kind] = self.level.errors.get(kind, 0) + 1
        if then is not None:
            then()  # the next request goes out before this one stops counting as outstanding
        with self.lock:
            self.outstanding -= 1
            if self.outstanding == 0 and self.closing:
                self.idle.set()

    def close(self) -> None:
        with self.lock:
            self.closing = True
            if self.outstanding == 0:
                self.idle.set()


def run_level(client, model: str, inputs: dict, mode: str, value: float, seconds: float, rows: int,
              display: Display | None = None) -> Level:
    level = Level(mode, value)
    run = _Run(client, model, inputs, rows, level)
    before = client.stats()[model]

    def counts() -> tuple:
        return _counts_in_order(level, run.latencies)

    with _Ticker(display, mode, value, seconds, 1, counts):
        start, cpu = time.perf_counter(), time.process_time()
        stop_at = start + seconds
        if mode == "concurrency":
            def again() -> None:
                if time.perf_counter() < stop_at:
                    run.send(again)

            for _ in range(int(value)):
                run.send(again)
            time.sleep(max(0.0, stop_at - time.perf_counter()))
        else:
            lag = 0.0
            for t in poisson_arrivals(value, seconds).tolist():
                wait = start + t - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                else:
                    lag = max(lag, -wait)
                run.send()
            level.send_lag_s = float(lag)
            level.client_saturated = bool(lag > SATURATION_LAG * seconds)
        run.close()
        run.idle.wait(seconds + 120)
    level.seconds = time.perf_counter() - start
    level.client_cpu = (time.process_time() - cpu) / level.seconds
    if mode == "concurrency":
        level.client_saturated = level.client_cpu >= SATURATION_CPU
    level.latency_ms = percentiles(run.latencies)
    level.throughput_rps = level.ok / level.seconds
    level.rows_per_s = level.rows / level.seconds
    level.server = server_window(before, client.stats()[model])
    level.raw_latencies = run.latencies  # kept off the report; a parent process merges them
    return level


def run_level_processes(client, endpoint: str, model: str, mode: str, value: float, seconds: float,
                        batch_size: int, processes: int, shared_memory: bool,
                        input_files: dict[str, str] | None = None, display: Display | None = None) -> Level:
    """One level split across several client processes (when one Python process cannot produce the
    load): each runs its share, the parent merges their counts and latencies and reads the server once."""
    import subprocess
    import sys

    before = client.stats()[model]
    share = value / processes
    args = {"endpoint": endpoint, "model": model, "mode": mode, "value": share if mode == "rate" else 0,
            "seconds": seconds, "batch_size": batch_size, "shared_memory": shared_memory,
            "inputs": input_files or {}}
    procs = []
    for i in range(processes):
        mine = dict(args, value=share if mode == "rate" else int(value) // processes + (i < int(value) % processes),
                    seed=i)
        procs.append(subprocess.Popen([sys.executable, "-m", "gepool.bench", json.dumps(mine)],
                                      stdout=subprocess.PIPE, text=True))
    level = Level(mode, value, processes=processes)
    latencies: list[float] = []

    def counts() -> tuple:  # the children report at their end: meanwhile, what the server has answered
        now = client.stats()[model]
        return None, now["requests"] - before["requests"], now["failures"] - before["failures"], None

    parts = []
    with _Ticker(display, mode, value, seconds, processes, counts):
        for proc in procs:
            out, _ = proc.communicate(timeout=seconds + 300)
            if proc.returncode != 0:
                raise errors.Internal(f"a bench client process failed (exit code {proc.returncode})")
            parts.append(json.loads(out))
    for part in parts:
        for key in ("sent", "ok", "rows"):
            setattr(level, key, getattr(level, key) + part[key])
        for kind, n in part["errors"].items():
            level.errors[kind] = level.errors.get(kind, 0) + n
        level.seconds = max(level.seconds, part["seconds"])
        level.send_lag_s = max(level.send_lag_s, part["send_lag_s"])
        level.client_saturated |= part["client_saturated"]
        level.client_cpu = max(level.client_cpu, part["client_cpu"])
        latencies += part["raw_latencies"]
    level.latency_ms = percentiles(latencies)
    level.throughput_rps = level.ok / level.seconds if level.seconds else 0.0
    level.rows_per_s = level.rows / level.seconds if level.seconds else 0.0
    level.server = server_window(before, client.stats()[model])
    return level


def _child(argv: list[str]) -> int:
    """``python -m gepool.bench ARGS_JSON``: one client process's share of a level, as JSON on stdout."""
    from gepool.client import Client

    a = json.loads(argv[0])
    with Client(a["endpoint"], shared_memory=a["shared_memory"]) as c:
        meta = c.model_metadata(a["model"])
        inputs = dict(make_inputs(meta, a["batch_size"], a.get("seed", 0)),
                      **{name: np.load(path) for name, path in a.get("inputs", {}).items()})
        rows = request_rows(inputs, meta.get("max_batch_size", 0) > 0)
        level = run_level(c, a["model"], inputs, a["mode"], a["value"], a["seconds"], rows)
    out = asdict(level)
    out["raw_latencies"] = level.raw_latencies
    print(json.dumps(out))
    return 0


def bench(client, model: str, concurrency: list[int] | None = None, rates: list[float] | None = None,
          seconds: float = 5.0, batch_size: int = 1, processes: int | str = 1, given: dict | None = None,
          display: Display | None = None) -> dict:
    """Every level in this process, or split across ``processes`` client processes; ``"auto"`` starts
    with one and doubles while the client side is saturated (up to the host's cores).
    ``given`` replaces generated inputs by name (arrays, e.g. loaded from .npy files); ``display``
    hears each level's progress as it runs, and its end."""
    meta = client.model_metadata(model)
    inputs = dict(make_inputs(meta, batch_size), **(given or {}))
    rows = request_rows(inputs, meta.get("max_batch_size", 0) > 0)
    plan = [("concurrency", c) for c in (concurrency or [])] + [("rate", r) for r in (rates or [])]
    auto = processes == "auto"
    most = max(1, os.cpu_count() or 1) if auto else int(processes)
    shm = getattr(client, "arena", None) is not None
    with tempfile.TemporaryDirectory(prefix="gepool-bench-") as tmp:
        files = {}
        for name, arr in (given or {}).items():  # child processes load the same data
            files[name] = os.path.join(tmp, f"input{len(files)}.npy")
            np.save(files[name], arr)

        def run(mode: str, value: float, n: int) -> Level:
            if n == 1:
                return run_level(client, model, inputs, mode, value, seconds, rows, display)
            return run_level_processes(client, client.endpoint, model, mode, value, seconds, batch_size, n,
                                       shm, files, display)

        levels = []
        for mode, value in plan:
            n = 1 if auto else most
            level = run(mode, value, n)
            while auto and level.client_saturated and 2 * n <= most and (mode == "rate" or value >= 2 * n):
                n *= 2
                if display is not None:
                    display.finished(level, again_with=n)
                level = run(mode, value, n)
            if display is not None:
                display.finished(level)
            levels.append(level)
    return {"model": model, "batch_size": batch_size, "seconds": seconds,
            "inputs": {k: list(v.shape) for k, v in inputs.items()}, "processes": processes,
            "pool": pool_setup(client, model), "levels": [asdict(x) for x in levels]}


def pool_setup(client, model: str) -> dict:
    """What the figures depend on besides the load: the model's workers and their threads, and whether
    the front polls (concurrency-1 latency differs by a third with and without)."""
    status = client.status()
    m = status["models"].get(model, {})
    return {"workers": len(m.get("worker_pids", [])), "worker_threads": m.get("worker_threads", []),
            "polling": status.get("polling", {}).get("mode", "unknown")}


def format_report(report: dict) -> str:
    pool = report.get("pool")
    setup = (f"; {pool['workers']} worker(s), threads {pool['worker_threads']}, front polling {pool['polling']}"
             if pool else "")
    lines = [f"model {report['model']}, batch {report['batch_size']}, {report['seconds']:.0f}s per level{setup}",
             f"{'load':>14s} {'req/s':>9s} {'rows/s':>9s} {'p50':>8s} {'p90':>8s} {'p95':>8s} {'p99':>8s} "
             f"{'max':>8s}  {'server batch':>12s} {'queue ms':>8s} {'compute ms':>10s}  errors"]
    for lv in report["levels"]:
        lat = lv["latency_ms"] or dict.fromkeys(("p50", "p90", "p95", "p99", "max"), math.nan)
        label = level_label(lv["mode"], lv["level"])
        s = lv["server"]
        lines.append(f"{label:>14s} {lv['throughput_rps']:9.1f} {lv['rows_per_s']:9.1f} "
                     + " ".join(f"{lat[k]:8.2f}" for k in ("p50", "p90", "p95", "p99", "max"))
                     + f"  {s['avg_batch_size']:12.2f} {s['queue_ms_avg']:8.2f} {s['compute_ms_avg']:10.2f}  "
                     + (json.dumps(lv["errors"]) if lv["errors"] else "-")
                     + (f"  ({lv.get('processes', 1)} client processes)" if lv.get("processes", 1) > 1 else "")
                     + ("  (client saturated)" if lv["client_saturated"] else ""))
    shares = [(lv, batch_shares(lv["server"].get("batch_sizes", {}))) for lv in report["levels"]]
    if any(s for _, s in shares):
        lines.append("batch sizes the server ran (rows: share of batches)")
        for lv, s in shares:
            top = ", ".join(f"{size}: {share:.0%}" if share >= 0.01 else f"{size}: <1%"
                            for size, share in s[:BATCH_SIZES_SHOWN])
            more = f" and {len(s) - BATCH_SIZES_SHOWN} more" if len(s) > BATCH_SIZES_SHOWN else ""
            lines.append(f"{level_label(lv['mode'], lv['level']):>14s}  {top or '-'}{more}")
    return "\n".join(lines)


BATCH_SIZES_SHOWN = 4


def batch_shares(sizes: dict) -> list[tuple[int, float]]:
    """(batch size, share of batches), the most frequent first; keys may be str (from JSON) or int."""
    total = sum(sizes.values())
    if not total:
        return []
    return sorted(((int(k), v / total) for k, v in sizes.items() if v), key=lambda kv: (-kv[1], kv[0]))


def plot(report: dict, path: str) -> None:
    """Latency percentiles against throughput, and the server's batch sizes per level, as one PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise errors.InvalidArgument("--plot needs matplotlib: pip install 'gepool[plot]'") from None
    levels = [lv for lv in report["levels"] if lv["latency_ms"]]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for mode, marker in (("concurrency", "o"), ("rate", "s")):
        pts = [lv for lv in levels if lv["mode"] == mode]
        if not pts:
            continue
        x = [lv["throughput_rps"] for lv in pts]
        for p, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            left.plot(x, [lv["latency_ms"][p] for lv in pts], style, marker=marker, label=f"{p} ({mode})")
        for lv, xi in zip(pts, x):
            left.annotate(f"{'c' if mode == 'concurrency' else 'r'}{lv['level']:g}", (xi, lv["latency_ms"]["p99"]),
                          fontsize=7, xytext=(3, 3), textcoords="offset points")
    left.set_xlabel("throughput (requests/s)")
    left.set_ylabel("latency (ms)")
    left.set_title(f"{report['model']}: latency against throughput")
    left.legend(fontsize=7)
    left.grid(alpha=0.3)
    sizes = sorted({int(k) for lv in levels for k in lv["server"]["batch_sizes"]})
    width = 0.8 / max(1, len(levels))
    for i, lv in enumerate(levels):
        share_of = dict(batch_shares(lv["server"]["batch_sizes"]))
        shares = [share_of.get(s, 0.0) for s in sizes]
        label = level_label(lv["mode"], lv["level"])
        right.bar([j + i * width for j in range(len(sizes))], shares, width, label=label)
    right.set_xticks([j + 0.4 - width / 2 for j in range(len(sizes))], [str(s) for s in sizes])
    right.set_xlabel("batch size (rows) the server ran")
    right.set_ylabel("share of batches")
    right.set_title("batch sizes per level")
    right.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


DEFAULT_DELAYS_US = (0, 500, 2000, 8000)
DEFAULT_COUNTS = (1, 2)
TIE_SHARE = 0.02


def _variant(repository: str, model: str, delay_us: int, count: int, into: str) -> None:
    """A copy of the model whose config has the given batching delay and instance count."""
    import os
    import shutil

    from google.protobuf import text_format

    from gepool.common import model_config_pb2 as pb

    src = os.path.join(repository, model)
    dst = os.path.join(into, model)
    shutil.copytree(src, dst, symlinks=True)
    path = os.path.join(dst, "config.pbtxt")
    with open(path) as f:
        cfg = text_format.Parse(f.read(), pb.ModelConfig())
    if cfg.max_batch_size > 0:
        cfg.dynamic_batching.max_queue_delay_microseconds = delay_us
    if not cfg.instance_group:
        cfg.instance_group.add()
    for g in cfg.instance_group:
        g.count = count
    with open(path, "w") as f:
        f.write(text_format.MessageToString(cfg))


def sweep(repository: str, model: str, concurrency: list[int] | None, seconds: float, p99_target_ms: float,
          delays_us=DEFAULT_DELAYS_US, counts=DEFAULT_COUNTS, batch_size: int = 1,
          rates: list[float] | None = None, given: dict | None = None, display: Display | None = None) -> dict:
    """Model Analyzer's question in minutes: for each (max_queue_delay, instance count) on a private pool,
    the best throughput whose p99 meets the target, over closed-loop ``concurrency`` levels and Poisson
    ``rates`` (where a batching delay shows in the tail). Returns every trial and the best setting."""
    import tempfile

    from gepool.pool import Pool

    if not concurrency and not rates:
        raise errors.InvalidArgument("a sweep needs at least one concurrency level or rate to measure")
    trials = []
    for delay in delays_us:
        for count in counts:
            if display is not None:
                display.note(f"max_queue_delay_microseconds {delay}, {count} instance(s):")
            with tempfile.TemporaryDirectory(prefix="gepool-sweep-") as repo:
                _variant(repository, model, delay, count, repo)
                with Pool(repo) as pool:
                    report = bench(pool.client(), model, concurrency, rates, seconds, batch_size, given=given,
                                   display=display)
            ok = [lv for lv in report["levels"] if lv["latency_ms"] and lv["latency_ms"]["p99"] <= p99_target_ms
                  and not lv["errors"]]
            best = max(ok, key=lambda lv: lv["throughput_rps"], default=None)
            trials.append({"max_queue_delay_us": delay, "instances": count, "levels": report["levels"],
                           "best_mode": best["mode"] if best else None,
                           "best_level": best["level"] if best else None,
                           "best_concurrency": best["level"] if best and best["mode"] == "concurrency" else None,
                           "best_rps": best["throughput_rps"] if best else 0.0,
                           "best_p99_ms": best["latency_ms"]["p99"] if best else None})
    return {"model": model, "p99_target_ms": p99_target_ms, "seconds": seconds, "trials": trials,
            "best": best_trial(trials)}


def best_trial(trials: list[dict]) -> dict | None:
    """The setting to recommend: the highest throughput that met the target, where throughputs within
    TIE_SHARE of it tie (an open-loop level runs at its offered rate whatever the setting, so picking
    the larger of two such figures picks noise) and the lowest p99 among them wins. None if none met it."""
    top = max((t["best_rps"] for t in trials), default=0.0)
    if top <= 0:
        return None
    winner = min((t for t in trials if t["best_rps"] >= (1 - TIE_SHARE) * top), key=lambda t: t["best_p99_ms"])
    return {k: winner[k] for k in ("max_queue_delay_us", "instances", "best_mode", "best_level",
                                   "best_concurrency", "best_rps", "best_p99_ms")}


def format_sweep(result: dict) -> str:
    lines = [f"sweep of {result['model']} for p99 <= {result['p99_target_ms']} ms",
             f"{'delay us':>9s} {'instances':>9s} {'best req/s':>11s} {'at level':>10s} {'p99 ms':>8s}"]
    for t in result["trials"]:
        p99 = f"{t['best_p99_ms']:8.2f}" if t["best_p99_ms"] is not None else f"{'-':>8s}"
        lines.append(f"{t['max_queue_delay_us']:9d} {t['instances']:9d} {t['best_rps']:11.1f} "
                     f"{level_label(t['best_mode'], t['best_level']):>10s} {p99}")
    b = result["best"]
    if b is None:
        lines.append("best: no setting met the target")
    else:
        lines.append(f"best: max_queue_delay_microseconds: {b['max_queue_delay_us']}, instance count "
                     f"{b['instances']} ({b['best_rps']:.1f} req/s at {level_label(b['best_mode'], b['best_level'])}, "
                     f"p99 {b['best_p99_ms']:.2f} ms)")
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    sys.exit(_child(sys.argv[1:]))
