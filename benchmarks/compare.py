"""The limit, the floor and gepool's carriers side by side in one run (method: benchmarks/README.md)."""

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

BIG = 4 * 1024 * 1024  # FP32 elements: 16 MiB
BUSY_POLL_US = 200


def make_big(repo: str) -> None:
    """y = x + 1 over 16 MiB, one request per batch."""
    import make_models
    from onnx import TensorProto, helper, numpy_helper

    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, [BIG])
    y = helper.make_tensor_value_info("Y", TensorProto.FLOAT, [BIG])
    one = numpy_helper.from_array(np.array(1.0, np.float32), "one")
    make_models._save(helper.make_graph([helper.make_node("Add", ["X", "one"], ["Y"])], "big", [x], [y], [one]),
                      f"{repo}/big/1/model.onnx")
    make_models._write(f"{repo}/big/config.pbtxt", f"""
        platform: "onnxruntime_onnx"
        max_batch_size: 0
        input [ {{ name: "X" data_type: TYPE_FP32 dims: [ {BIG} ] }} ]
        output [ {{ name: "Y" data_type: TYPE_FP32 dims: [ {BIG} ] }} ]
    """)


def make_static_twin(repo: str) -> None:
    """The example MLP with Triton's static batch policy, to set beside the adaptive one."""
    import shutil

    shutil.copytree(f"{repo}/mlp", f"{repo}/mlp_static")
    with open(f"{repo}/mlp_static/config.pbtxt") as f:
        text = f.read().replace('name: "mlp"', 'name: "mlp_static"').replace('"adaptive"', '"triton"')
    with open(f"{repo}/mlp_static/config.pbtxt", "w") as f:
        f.write(text)


def poisson_rows(client, capacity: float, seconds: float) -> list[tuple[str, str, str]]:
    from gepool.bench import make_inputs, run_level

    x = make_inputs(client.model_metadata("mlp"), 1)
    rows = []
    for model in ("mlp", "mlp_static"):
        policy = "adaptive" if model == "mlp" else "static"
        lone = run_level(client, model, x, "concurrency", 1, seconds, 1)
        rows.append((f"gepool MLP c=1, {policy} batching", f"p50 {lone.latency_ms['p50']:.1f} ms",
                     f"{lone.rows_per_s:.0f} rows/s"))
        lv = run_level(client, model, x, "rate", 0.7 * capacity, 2 * seconds, 1)
        compute = lv.server["compute_ms_avg"]
        rows.append((f"gepool MLP Poisson {0.7 * capacity:.0f}/s, {policy} batching",
                     f"p99 {lv.latency_ms['p99']:.1f} ms",
                     f"{lv.latency_ms['p99'] / compute:.2f}x compute ({compute:.1f} ms, "
                     f"batch {lv.server['avg_batch_size']:.1f})"))
    return rows


def versus_floor(label: str, p50_s: float, floors: list[float]) -> tuple[str, str, str]:
    """A latency row against the floor measured right after it: this host drifts over a run (the floor
    read 75-113 us in one session), and a ratio should compare two neighbouring moments."""
    import core

    floor = float(np.median(core.zmq_floor(1000)))
    floors.append(floor)
    return label, f"p50 {p50_s * 1e6:.0f} us", f"{p50_s / floor:.2f}x floor ({floor * 1e6:.0f} us right after)"


def cpu_budget_row(cpu: dict[str, float], n_rows: float, limit: tuple[float, float]) -> tuple[str, str, str]:
    """What 0.85x the limit leaves for serving on this host's cores, beside what gepool's front and
    client spend. The limit keeps every core busy in onnxruntime; whatever a server spends beside it
    comes out of the same cores. ``limit``: the best in-process rows/s and onnxruntime's CPU per row
    at batch 16, measured together at the start. (The worker's own share beside onnxruntime is left
    out: it is the difference of two CPU figures taken at different moments, and this host's speed
    drifts by a fifth within a run, so it read anywhere from -112 to +171 us.)"""
    cores = len(os.sched_getaffinity(0))
    best_rate, ort_cpu = limit
    budget = cores / (0.85 * best_rate) - ort_cpu  # per row, beside onnxruntime's own at batch 16
    front, client = cpu["front"] / n_rows, cpu["client"] / n_rows
    return ("  CPU per row, front and client", f"{(front + client) * 1e6:.0f} us",
            f"front {front * 1e6:.0f}, client {client * 1e6:.0f}; 0.85x limit on {cores} cores leaves "
            f"{budget * 1e6:.0f} beside onnxruntime's {ort_cpu * 1e6:.0f}")


def timed(fn, seconds: float) -> tuple[int, float]:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn()
        n += 1
    return n, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()

    import core
    import http_bench

    from gepool import Pool

    repo = core.example_repo("gepool-compare-")
    make_static_twin(repo)
    make_big(repo)
    rows = []

    floors: list[float] = []
    best_bs, best_rate, ort_rates = core.ort_limit(f"{repo}/mlp/1/model.onnx", len(os.sched_getaffinity(0)),
                                                   args.seconds)
    rows.append((f"onnxruntime in-process MLP, batch {best_bs} (limit)", f"{best_rate:.0f} rows/s", ""))
    bound = ort_rates[16][0]  # sixteen closed-loop requests form no larger batch: no server passes this at c=16
    rows.append(("onnxruntime in-process MLP, batch 16 (c=16 bound)", f"{bound:.0f} rows/s",
                 f"{bound / best_rate:.2f}x limit"))

    port = http_bench.free_port()
    with Pool(repo, http_port=port) as pool:
        frames, shm = pool.client(), pool.client(shared_memory=True, arena_bytes=96 << 20)
        capacity = 0.0
        for name, client in (("frames", frames), ("shared memory", shm)):
            rows.append(versus_floor(f"gepool tiny c=1, {name}", np.median(core.tiny_latency(client, 2000)), floors))
            t0 = time.perf_counter()
            rate, cpu = core.serving_cpu(pool, lambda c=client: core.mlp_throughput(c, 16, args.seconds))
            capacity = max(capacity, rate)
            rows.append((f"gepool MLP c=16, {name}", f"{rate:.0f} rows/s",
                         f"{rate / best_rate:.2f}x limit, {rate / bound:.2f}x c=16 bound"))
            rows.append(cpu_budget_row(cpu, rate * (time.perf_counter() - t0), (best_rate, ort_rates[16][1])))
        with pool.client(lane=False) as over_zmq:
            rows.append(versus_floor("gepool tiny c=1, frames, ZMQ instead of a lane",
                                     np.median(core.tiny_latency(over_zmq, 2000)), floors))
        rows += poisson_rows(frames, capacity, args.seconds)
        http = http_bench.perf_analyzer("tiny", port, 1, args.seconds)
        if http:
            rows.append(versus_floor("gepool tiny c=1, HTTP (perf_analyzer)", http["p50_us"] / 1e6, floors))
        x = np.random.default_rng(0).random(BIG, dtype=np.float32)
        dst = np.empty_like(x)
        n, t = timed(lambda: np.copyto(dst, x), args.seconds)
        memcpy_gbs = n * x.nbytes / t / 2**30
        rows.append(("memcpy 16 MiB in-process", f"{memcpy_gbs:.1f} GiB/s", ""))
        placed = shm.empty(x.shape, x.dtype)  # written in the arena: the request carries an offset
        placed[:] = x
        for name, client, arr in (("shared memory, input made with Client.empty", shm, placed),
                                  ("shared memory, numpy input", shm, x), ("frames", frames, x)):
            client.infer("big", {"X": arr})
            n, t = timed(lambda c=client, a=arr: c.infer("big", {"X": a}), args.seconds)
            gbs = n * 2 * x.nbytes / t / 2**30  # 16 MiB in and 16 MiB out per request
            rows.append((f"gepool 16 MiB in + out, {name}", f"{gbs:.2f} GiB/s", f"{gbs / memcpy_gbs:.2f}x memcpy"))
    with Pool(repo, busy_poll_us=BUSY_POLL_US) as pool:  # the latency knob, off by default
        client = pool.client()
        rows.append(versus_floor(f"gepool tiny c=1, frames, busy poll {BUSY_POLL_US} us",
                                 np.median(core.tiny_latency(client, 2000)), floors))
        rate = core.mlp_throughput(client, 16, args.seconds)
        rows.append((f"gepool MLP c=16, frames, busy poll {BUSY_POLL_US} us", f"{rate:.0f} rows/s",
                     f"{rate / best_rate:.2f}x limit, {rate / bound:.2f}x c=16 bound"))
    with Pool(repo, busy_poll_us=-1) as pool:  # what the default's adaptive polling buys
        rows.append(versus_floor("gepool tiny c=1, frames, polling off (-1)",
                                 np.median(core.tiny_latency(pool.client(), 2000)), floors))
    rows.insert(0, ("pyzmq REQ/REP round trip (floor), over the run",
                    f"p50 {min(floors) * 1e6:.0f}-{max(floors) * 1e6:.0f} us", ""))
    width = max(len(r[0]) for r in rows)
    for label, value, ratio in rows:
        print(f"{label:<{width}}  {value:>16}  {ratio}")


if __name__ == "__main__":
    main()
