"""The sidecar's CPU per request for the MLP's JSON with the MLP behind it and with a weightless model of the same
inputs and outputs (a Slice of the 1,024 inputs to the 1,000 outputs), alternating in rounds.

    python benchmarks/model_weight.py [--rounds 3] [--seconds 6] [--levels 8,64]

The same requests and answers (wrk's KServe JSON body of ``gateway_bench.py``, 1,000 doubles back) and the same
batching (the peers' settings): what the sidecar spends beyond the weightless figure comes with the model that
shares the host's cores (its computing, its rate), not with the route. CPU per request as ``gateway_bench.py``
counts it (utime+stime over the level / the requests the pool counted).
"""

import argparse
import statistics
import time

import gateway_bench
import make_models
import numpy as np

WIDTH_IN, WIDTH_OUT = 1024, 1000


def weightless_mlp(repo: str) -> None:
    """``make_models.make_mlp``'s folder and config, its model a Slice: LOGITS = INPUT[:, :1000]."""
    from onnx import TensorProto, helper, numpy_helper

    REAL_MAKE_MLP(repo, sizes=(WIDTH_IN, WIDTH_OUT))
    x = helper.make_tensor_value_info("INPUT", TensorProto.FLOAT, ["batch", WIDTH_IN])
    y = helper.make_tensor_value_info("LOGITS", TensorProto.FLOAT, ["batch", WIDTH_OUT])
    bounds = [numpy_helper.from_array(np.array([v], np.int64), n) for n, v in (("s", 0), ("e", WIDTH_OUT), ("a", 1))]
    graph = helper.make_graph([helper.make_node("Slice", ["INPUT", "s", "e", "a"], ["LOGITS"])], "mlp", [x], [y],
                              bounds)
    make_models._save(graph, f"{repo}/mlp/1/model.onnx")


REAL_MAKE_MLP = make_models.make_mlp
MAKERS = {"MLP": REAL_MAKE_MLP, "weightless": weightless_mlp}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--levels", default="8,64")
    args = p.parse_args()
    levels = [int(c) for c in args.levels.split(",")]
    results: dict[tuple[str, int], list[dict]] = {}
    try:
        for r in range(args.rounds):
            for kind in (MAKERS if r % 2 == 0 else reversed(MAKERS)):  # drift falls on both alike
                make_models.make_mlp = MAKERS[kind]  # (gateway_bench.make_repo calls it)
                with gateway_bench.served("gepool-weight-") as (pool, url, workdir):
                    gateway_bench.run_wrk(url, "mlp", 8, 1.0, workdir)  # warm-up
                    procs = gateway_bench.processes(pool.process.pid, None)
                    for conc in levels:
                        got = gateway_bench.level(gateway_bench.run_wrk, url, pool.client(), procs, "mlp", conc,
                                                  args.seconds, workdir)
                        results.setdefault((kind, conc), []).append(got)
                        workers = sum(v for k, v in got["cpu_us"].items() if k.startswith("worker"))
                        print(f"round {r + 1} {kind:10s} c={conc:<3d} {got['rps']:7.0f} req/s batch "
                              f"{got['avg_batch']:5.1f}  CPU us/req: sidecar {got['cpu_us']['sidecar']:6.1f} front "
                              f"{got['cpu_us']['front']:5.1f} workers {workers:7.1f}  errors {got['errors']}",
                              flush=True)
    finally:
        make_models.make_mlp = REAL_MAKE_MLP
    print(f"\nmedians over {args.rounds} rounds: the sidecar's CPU us per request ({time.strftime('%F %T')})")
    for conc in levels:
        line = [f"c={conc:<3d}"]
        for kind in MAKERS:
            runs = results[(kind, conc)]
            line.append(f"{kind} {statistics.median(x['cpu_us']['sidecar'] for x in runs):6.1f} "
                        f"({statistics.median(x['rps'] for x in runs):.0f} req/s)")
        print("  ".join(line))


if __name__ == "__main__":
    main()
