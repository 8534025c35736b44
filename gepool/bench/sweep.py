"""``gepool bench --sweep``: batching delays and instance counts tried on private pools, and the best one."""

import os
import shutil
import tempfile

from gepool.bench.display import Display
from gepool.bench.library import bench
from gepool.bench.results import level_label
from gepool.common import errors

DEFAULT_DELAYS_US = (0, 500, 2000, 8000)
DEFAULT_COUNTS = (1, 2)
TIE_SHARE = 0.02  # throughputs this close to the most count as equal


def _variant(repository: str, model: str, delay_us: int, count: int, into: str) -> None:
    """A copy of the model whose config has the given batching delay and instance count."""
    from google.protobuf import text_format

    from gepool.common import model_config_pb2 as pb

    dst = os.path.join(into, model)
    shutil.copytree(os.path.join(repository, model), dst, symlinks=True)
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
