"""onnxruntime's intra-op spin-wait off and on, through gepool (method: benchmarks/README.md)."""

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def tree_cpu(pid: int) -> float:
    import core

    """CPU seconds of a process and its children (the front and its workers)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += core.cpu_seconds(p)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def measure(repo: str, spinning: str, seconds: float, heavy_rate: float | None) -> dict:
    """``heavy_rate``: the heavy Poisson level's rate; None sets it to 70% of this pool's concurrency-16
    rows/s (the first pool measured sets it for all: each setting gets the same load)."""
    from gepool import Pool
    from gepool.bench import make_inputs, run_level

    for name in ("tiny", "mlp"):
        path = f"{repo}/{name}/config.pbtxt"
        with open(path) as f:
            text = f.read().split("# spinning")[0]
        with open(path, "w") as f:
            f.write(text + "# spinning\n"
                    f'parameters {{ key: "allow_spinning" value: {{ string_value: "{spinning}" }} }}\n')
    out = {}
    with Pool(repo) as pool:
        client = pool.client()
        for model, mode, value, key in (("tiny", "concurrency", 1, "tiny_c1"), ("mlp", "concurrency", 16, "mlp_c16"),
                                        ("mlp", "rate", 100, "mlp_r100"), ("mlp", "rate", None, "mlp_r70")):
            if value is None:
                value = heavy_rate or 0.7 * out["mlp_c16"][0].rows_per_s
                out["heavy_rate"] = value
            x = make_inputs(client.model_metadata(model), 1)
            for _ in range(10):
                client.infer(model, x)
            cpu = tree_cpu(pool.process.pid)
            lv = run_level(client, model, x, mode, value, seconds, 1)
            out[key] = (lv, (tree_cpu(pool.process.pid) - cpu) / max(lv.ok, 1))
        time.sleep(seconds)  # idle: what the pool burns with nothing to do
        cpu = tree_cpu(pool.process.pid)
        time.sleep(seconds)
        out["idle"] = (tree_cpu(pool.process.pid) - cpu) / seconds
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, HERE)
    from core import example_repo

    repo = example_repo("gepool-spin-")
    results: dict[str, list[dict]] = {"0": [], "1": []}
    heavy = None
    for _ in range(args.rounds):
        for spinning in ("0", "1"):
            results[spinning].append(measure(repo, spinning, args.seconds, heavy))
            heavy = results[spinning][-1]["heavy_rate"]
    print(f"heavy Poisson load: {heavy:.0f} requests/s for every setting")
    print(f"{'allow_spinning':<15}{'tiny c=1 p50':>14}{'CPU/req':>10}{'MLP c=16':>12}{'CPU/req':>10}"
          f"{'MLP 100/s p99':>15}{'CPU/req':>10}{'MLP 70% p99':>13}{'idle CPU':>10}")
    for spinning, runs in results.items():
        for r in runs:
            tiny, tiny_cpu = r["tiny_c1"]
            mlp, mlp_cpu = r["mlp_c16"]
            light, light_cpu = r["mlp_r100"]
            loaded, _ = r["mlp_r70"]
            print(f"{spinning:<15}{tiny.latency_ms['p50'] * 1000:>11.0f} us{tiny_cpu * 1e6:>7.0f} us"
                  f"{mlp.rows_per_s:>7.0f} r/s{mlp_cpu * 1e3:>7.2f} ms{light.latency_ms['p99']:>12.2f} ms"
                  f"{light_cpu * 1e3:>7.2f} ms{loaded.latency_ms['p99']:>10.1f} ms{r['idle']:>9.2f}c")
    med = {s: {k: float(np.median([r[k][0].rows_per_s if k == "mlp_c16" else r[k][0].latency_ms["p50"]
                                   for r in runs])) for k in ("tiny_c1", "mlp_c16")} for s, runs in results.items()}
    print(f"median MLP c=16: spinning on/off = {med['1']['mlp_c16'] / med['0']['mlp_c16']:.2f}; "
          f"tiny p50 on/off = {med['1']['tiny_c1'] / med['0']['tiny_c1']:.2f}")


if __name__ == "__main__":
    main()
