"""One load level from this process: closed loop (concurrency) or open loop (Poisson arrivals)."""

import threading
import time

import numpy as np

from gepool.bench.display import Display
from gepool.bench.results import Level, percentiles, server_window
from gepool.bench.ticker import Ticker, counts_in_order
from gepool.common import errors
from gepool.ipc import dtypes

SATURATION_LAG = 0.1  # open loop: sending more than 10% of the run late means the client could not keep up
SATURATION_CPU = 0.9  # closed loop: a client process busy 90% of the time (of one core) is the bottleneck
DRAIN_GRACE_S = 120.0  # how long a level waits for its last answers after its end


def poisson_arrivals(rate: float, seconds: float, seed: int = 0) -> np.ndarray:
    """Arrival times (from 0) of a Poisson process of the given rate over ``seconds``."""
    rng = np.random.default_rng(seed)
    n = int(rate * seconds * 1.2) + 16
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    while times[-1] < seconds:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, n))])
    return times[times < seconds]


def make_inputs(meta: dict, batch_size: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs of the model's shapes (variable dims become 1), with batch_size rows when it batches;
    a ModelNotReady for metadata without inputs (a model whose config did not load)."""
    if "inputs" not in meta:
        why = f": {meta['reason']}" if meta.get("reason") else ""
        raise errors.ModelNotReady(f"model '{meta.get('name', '?')}' declares no inputs to send: it is "
                                   f"{meta.get('state', 'not ready')}{why}")
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
    """One level from this process, with the server's view of its window."""
    return measure(client, model, inputs, mode, value, seconds, rows, display)[0]


def measure(client, model: str, inputs: dict, mode: str, value: float, seconds: float, rows: int,
            display: Display | None = None) -> tuple[Level, list[float]]:
    """``run_level`` and every answer's latency in seconds (which a parent process merges).

    The load runs on the client's I/O thread (each answer sends the next request), or from this thread
    at each arrival time, so one Python thread keeps many requests in flight. The client side counts as
    saturated when the sender falls behind the arrival times (open loop) or this process used nearly a
    whole core (closed loop: one Python process cannot go faster than that)."""
    level = Level(mode, value)
    run = _Run(client, model, inputs, rows, level)
    before = client.stats()[model]

    def counts() -> tuple:
        return counts_in_order(level, run.latencies)

    with Ticker(display, mode, value, seconds, 1, counts):
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
        run.idle.wait(seconds + DRAIN_GRACE_S)
    level.seconds = time.perf_counter() - start
    level.client_cpu = (time.process_time() - cpu) / level.seconds
    if mode == "concurrency":
        level.client_saturated = level.client_cpu >= SATURATION_CPU
    level.latency_ms = percentiles(run.latencies)
    level.throughput_rps = level.ok / level.seconds
    level.rows_per_s = level.rows / level.seconds
    level.server = server_window(before, client.stats()[model])
    return level, run.latencies
