"""``gepool bench --http URL``: the same levels over Triton's KServe v2 HTTP protocol, from one asyncio loop."""

import asyncio
import json
import time
from dataclasses import asdict

import numpy as np

from gepool.bench.display import Display
from gepool.bench.load import SATURATION_CPU, SATURATION_LAG, make_inputs, poisson_arrivals, request_rows
from gepool.bench.results import Level, percentiles, window
from gepool.bench.ticker import Ticker, counts_in_order
from gepool.common import errors
from gepool.ipc import dtypes

HEADER_LENGTH = "Inference-Header-Content-Length"


def _body(inputs: dict[str, np.ndarray]) -> tuple[bytes, dict]:
    blobs, entries = [], []
    for name, arr in inputs.items():
        raw = dtypes.serialize_bytes(arr) if arr.dtype == object else np.ascontiguousarray(arr).tobytes()
        entries.append({"name": name, "shape": list(arr.shape), "datatype": dtypes.from_numpy(arr.dtype),
                        "parameters": {"binary_data_size": len(raw)}})
        blobs.append(raw)
    header = json.dumps({"inputs": entries, "parameters": {"binary_data_output": True}}).encode()
    return header + b"".join(blobs), {HEADER_LENGTH: str(len(header))}


def _window(before: dict, after: dict) -> dict:
    """The server's view of a level from two ``/v2/models/{m}/stats`` answers (Triton's statistics)."""
    b, a = before["model_stats"][0], after["model_stats"][0]

    def ns(key: str) -> int:
        return a["inference_stats"][key]["ns"] - b["inference_stats"][key]["ns"]

    reqs = a["inference_stats"]["success"]["count"] - b["inference_stats"]["success"]["count"]
    batches = a["execution_count"] - b["execution_count"]
    sizes_b = {s["batch_size"]: s["compute_infer"]["count"] for s in b["batch_stats"]}
    sizes = {s["batch_size"]: s["compute_infer"]["count"] - sizes_b.get(s["batch_size"], 0) for s in a["batch_stats"]}
    return window(reqs, batches, a["inference_count"] - b["inference_count"], ns("queue") / 1e6,
                  ns("compute_infer") / 1e6, sizes)


async def _level(session, url: str, model: str, body: bytes, headers: dict, mode: str, value: float,
                 seconds: float, rows: int, display: Display | None) -> Level:
    level, latencies = Level(mode, value), []

    def counts() -> tuple:  # read by the ticker's thread
        return counts_in_order(level, latencies)

    async def one() -> None:
        start = time.perf_counter()
        level.sent += 1
        try:
            async with session.post(f"{url}/v2/models/{model}/infer", data=body, headers=headers) as resp:
                await resp.read()
                ok, kind = resp.status == 200, f"HTTP_{resp.status}"
        except Exception as exc:  # connection refused, reset...: counted, never lost
            ok, kind = False, type(exc).__name__
        if ok:  # the latency before the count, as the library client's load records them
            latencies.append(time.perf_counter() - start)
            level.ok += 1
            level.rows += rows
        else:
            level.errors[kind] = level.errors.get(kind, 0) + 1

    before = await _get(session, f"{url}/v2/models/{model}/stats")
    start, cpu = time.perf_counter(), time.process_time()
    with Ticker(display, mode, value, seconds, 1, counts):
        if mode == "concurrency":
            async def loop() -> None:
                while time.perf_counter() - start < seconds:
                    await one()

            await asyncio.gather(*(loop() for _ in range(int(value))))
        else:
            tasks, lag = [], 0.0
            for t in poisson_arrivals(value, seconds).tolist():
                wait = start + t - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                else:
                    lag = max(lag, -wait)
                tasks.append(asyncio.ensure_future(one()))
            await asyncio.gather(*tasks)
            level.send_lag_s, level.client_saturated = float(lag), bool(lag > SATURATION_LAG * seconds)
    level.seconds = time.perf_counter() - start
    level.client_cpu = (time.process_time() - cpu) / level.seconds
    if mode == "concurrency":  # one asyncio loop on one core: as the library client's rule
        level.client_saturated = level.client_cpu >= SATURATION_CPU
    level.latency_ms = percentiles(latencies)
    level.throughput_rps = level.ok / level.seconds
    level.rows_per_s = level.rows / level.seconds
    level.server = _window(before, await _get(session, f"{url}/v2/models/{model}/stats"))
    return level


async def _get(session, url: str) -> dict:
    """A GET's JSON answer, or an Unavailable naming the URL and what the server said instead."""
    import aiohttp

    try:
        async with session.get(url) as resp:
            body = await resp.text()
            status = resp.status
    except aiohttp.ClientError as exc:
        raise errors.Unavailable(f"GET {url}: {exc}") from None
    try:
        answer = json.loads(body) if body else {}
    except ValueError:
        answer = None
    if status != 200 or not isinstance(answer, dict):
        said = answer.get("error") if isinstance(answer, dict) and answer.get("error") else body[:200]
        raise errors.Unavailable(f"GET {url}: HTTP {status}: {said or 'no KServe v2 answer'}")
    return answer


async def _bench(url: str, model: str, concurrency, rates, seconds: float, batch_size: int,
                 given: dict | None, display: Display | None) -> dict:
    import aiohttp

    url = url.rstrip("/") if "://" in url else f"http://{url.rstrip('/')}"
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        meta = await _get(session, f"{url}/v2/models/{model}")
        meta["max_batch_size"] = (await _get(session, f"{url}/v2/models/{model}/config")).get("max_batch_size", 0)
        inputs = dict(make_inputs(meta, batch_size), **(given or {}))
        body, headers = _body(inputs)
        rows = request_rows(inputs, meta["max_batch_size"] > 0)
        plan = [("concurrency", c) for c in concurrency or []] + [("rate", r) for r in rates or []]
        levels = []
        for m, v in plan:
            levels.append(await _level(session, url, model, body, headers, m, v, seconds, rows, display))
            if display is not None:
                display.finished(levels[-1])
    return {"model": model, "batch_size": batch_size, "seconds": seconds, "http": url,
            "inputs": {k: list(v.shape) for k, v in inputs.items()}, "processes": 1,
            "levels": [asdict(x) for x in levels]}


def bench_http(url: str, model: str, concurrency: list[int] | None = None, rates: list[float] | None = None,
               seconds: float = 5.0, batch_size: int = 1, given: dict | None = None,
               display: Display | None = None) -> dict:
    """``bench``'s levels against a KServe v2 HTTP endpoint (binary tensors); the server's window comes
    from the standard ``/v2/models/{m}/stats``. ``given`` and ``display`` as ``bench``'s."""
    return asyncio.run(_bench(url, model, concurrency, rates, seconds, batch_size, given, display))
