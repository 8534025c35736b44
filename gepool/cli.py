"""The ``gepool`` command: start, status, infer, cleanup."""

import argparse
import json
import logging
import sys

import numpy as np

from gepool.common import errors


def _processes(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"--processes must be a whole number >= 1 or 'auto', not '{text}'")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gepool", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="serve a model repository in the foreground")
    p.add_argument("--model-repository", required=True, help="folder of <model>/config.pbtxt and <model>/<version>/")
    p.add_argument("--endpoint", help="ipc://PATH or tcp://HOST:PORT (default: ipc in your runtime dir)")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="onnxruntime threads per CPU model, split among its instances (default: every core)")
    p.add_argument("--http-port", type=int, default=8000, help="KServe v2 HTTP port (0: off)")
    p.add_argument("--http-host", default="127.0.0.1", help="address the HTTP and metrics ports bind")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics port (0: off)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--model-control-mode", choices=["none", "explicit", "poll"], default="none",
                   help="none: serve the repository as started; explicit: load/unload on request; poll: follow it")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="explicit mode: a model to load at start (repeatable)")
    p.add_argument("--repository-poll-secs", type=float, default=15.0, help="poll mode: seconds between scans")
    p.add_argument("--exit-timeout-secs", type=float, default=0.0,
                   help="on SIGTERM, report not ready but keep serving this long before draining (default 0)")
    p.add_argument("--curve-secret-key", help="ZMQ certificate file: CURVE encryption/auth for a tcp endpoint")
    p.add_argument("--curve-authorized-keys", help="folder of client .key files admitted (default: any key)")
    p.add_argument("--busy-poll-us", type=int, default=0,
                   help="0 (default): while traffic is sequential the front polls, instead of sleeping, "
                        "for what is due within microseconds (a short batch's completion, the next request "
                        "of a client sending back to back); N > 0: polls N us before any sleep; -1: never polls")

    p = sub.add_parser("status", help="models and their states")
    p.add_argument("--endpoint")

    p = sub.add_parser("infer", help="send one request (random inputs unless given)")
    p.add_argument("model")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--endpoint")
    p.add_argument("--shared-memory", action="store_true")

    for action in ("load", "unload"):
        p = sub.add_parser(action, help=f"{action} a model (pools started with --model-control-mode explicit/poll)")
        p.add_argument("model")
        p.add_argument("--endpoint")

    p = sub.add_parser("bench", help="load a model at concurrency levels or Poisson rates; latency and throughput")
    p.add_argument("model")
    p.add_argument("--endpoint")
    p.add_argument("--http", metavar="URL", help="load the KServe v2 HTTP endpoint instead (e.g. localhost:8000)")
    p.add_argument("--concurrency", default="", help="closed-loop levels, e.g. 1,2,4,8,16")
    p.add_argument("--rate", default="", help="open-loop Poisson arrival rates (requests/s), e.g. 100,200")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per level")
    p.add_argument("--batch-size", type=int, default=1, help="rows per request")
    p.add_argument("--shared-memory", action="store_true",
                   help="a shared-memory client, as a user's would be: requests under 64 KiB still go as frames")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy", help="use this data")
    p.add_argument("--processes", type=_processes, default="auto",
                   help="client processes sharing each level, or 'auto' (the default): one, doubled while "
                        "the client side is saturated")
    p.add_argument("--output", help="write the report as JSON here")
    p.add_argument("--plot", help="write a PNG of latency against throughput and batch sizes (needs matplotlib)")
    p.add_argument("--sweep", action="store_true",
                   help="try a grid of max_queue_delay_microseconds and instance counts on private pools")
    p.add_argument("--model-repository", help="--sweep: the repository holding MODEL")
    p.add_argument("--p99-target-ms", type=float, default=100.0, help="--sweep: the latency the setting must meet")

    p = sub.add_parser("cleanup", help="remove shared-memory segments left by dead pools")
    p.add_argument("--dry-run", action="store_true")

    args = parser.parse_args(argv)
    try:
        return globals()[f"_cmd_{args.command}"](args)
    except errors.GepoolError as exc:
        print(f"gepool {args.command}: {exc}", file=sys.stderr)
        return 1


def _cmd_start(args) -> int:
    from gepool.ipc.sockets import default_endpoint
    from gepool.pool import serve

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    endpoint = args.endpoint or default_endpoint()

    def ready(status: dict) -> None:
        for name, m in status["models"].items():
            line = f"model {name}: {m['state']}"
            line += f" (version {m['version']}, {m['ready_workers']} worker(s))" if m["state"] == "READY" else ""
            line += f" - {m['reason']}" if m["reason"] else ""
            print(line, flush=True)
        if status.get("http"):
            print(f"HTTP (KServe v2) on {status['http']}", flush=True)
        if status.get("metrics"):
            print(f"metrics on {status['metrics']}", flush=True)
        print(f"gepool ready on {status['endpoint']}", flush=True)

    print(f"gepool starting on {endpoint}", flush=True)
    return serve(args.model_repository, endpoint, cpu_threads=args.cpu_threads,
                 log_level=logging.getLevelName(args.log_level.upper()), on_ready=ready, http_port=args.http_port,
                 http_host=args.http_host, metrics_port=args.metrics_port, curve_secret_key=args.curve_secret_key,
                 curve_authorized_keys=args.curve_authorized_keys, exit_grace_s=args.exit_timeout_secs,
                 model_control_mode=args.model_control_mode, load_models=tuple(args.load_model),
                 poll_secs=args.repository_poll_secs, busy_poll_us=args.busy_poll_us)


def _cmd_status(args) -> int:
    from gepool.client import Client

    with Client(args.endpoint) as c:
        print(json.dumps(c.status(), indent=2))
    return 0


def _cmd_infer(args) -> int:
    from gepool.client import Client
    from gepool.ipc import dtypes

    with Client(args.endpoint, shared_memory=args.shared_memory) as c:
        meta = c.model_metadata(args.model)
        given = dict(item.split("=", 1) for item in args.input)
        inputs = {}
        rng = np.random.default_rng(0)
        for t in meta.get("inputs", []):
            if t["name"] in given:
                inputs[t["name"]] = np.load(given.pop(t["name"]))
                continue
            shape = [args.batch_size if i == 0 and meta["max_batch_size"] > 0 else (d if d > 0 else 1)
                     for i, d in enumerate(t["shape"])]
            dtype = dtypes.to_numpy(t["datatype"])
            inputs[t["name"]] = (rng.random(shape) * 10).astype(dtype)
        if given:
            raise errors.InvalidArgument(f"model '{args.model}' has no input {sorted(given)}")
        outputs = c.infer(args.model, inputs)
    for name, arr in outputs.items():
        print(f"{name} {arr.dtype} {list(arr.shape)}")
        print(np.array2string(arr, threshold=20, edgeitems=3))
    return 0


def _cmd_load(args) -> int:
    from gepool.client import Client

    with Client(args.endpoint) as c:
        print(json.dumps(c.load(args.model)))
    return 0


def _cmd_unload(args) -> int:
    from gepool.client import Client

    with Client(args.endpoint) as c:
        print(json.dumps(c.unload(args.model)))
    return 0


def _cmd_bench(args) -> int:
    from gepool.bench import TerminalDisplay, bench, format_report
    from gepool.client import Client

    display = TerminalDisplay(sys.stderr)  # progress on stderr: stdout keeps the report

    concurrency = [int(x) for x in args.concurrency.split(",") if x]
    rates = [float(x) for x in args.rate.split(",") if x]
    if not concurrency and not rates:
        concurrency = [1, 2, 4, 8, 16]
    given = _given(args.input)
    if args.http or args.sweep:  # these load with one client process of their own: say so, not ignore
        if args.shared_memory:
            raise errors.InvalidArgument("--shared-memory is the library client's carrier: it does not go with "
                                         f"{'--http' if args.http else '--sweep'}")
        if args.processes not in ("auto", 1):
            raise errors.InvalidArgument("--processes splits the library client's load: it does not go with "
                                         f"{'--http' if args.http else '--sweep'}")
    if args.http and args.endpoint:
        raise errors.InvalidArgument("--http loads the HTTP endpoint: it does not take --endpoint as well")
    if args.sweep:
        from gepool.bench import format_sweep, sweep

        if args.http or args.endpoint or args.plot:
            raise errors.InvalidArgument("--sweep starts its own pools and prints a table: it does not take "
                                         "--http, --endpoint or --plot")
        if not args.model_repository:
            raise errors.InvalidArgument("--sweep needs --model-repository (it starts its own pools)")
        result = sweep(args.model_repository, args.model, concurrency, args.duration, args.p99_target_ms,
                       batch_size=args.batch_size, rates=rates, given=given, display=display)
        print(format_sweep(result))
        if args.output:
            with open(args.output, "w") as f:
                json.dump(result, f, indent=2)
        return 0
    if args.http:
        from gepool.bench import bench_http

        report = bench_http(args.http, args.model, concurrency, rates, args.duration, args.batch_size, given,
                            display)
    else:
        with Client(args.endpoint, shared_memory=args.shared_memory) as c:
            report = bench(c, args.model, concurrency, rates, args.duration, args.batch_size, args.processes,
                           given, display)
    print(format_report(report))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)
    if args.plot:
        from gepool.bench import plot

        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _given(items: list[str]) -> dict[str, np.ndarray]:
    """--input NAME=FILE.npy, each loaded now, so that a typo is an error before any load runs."""
    given = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise errors.InvalidArgument(f"--input takes NAME=FILE.npy, not '{item}'")
        try:
            given[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise errors.InvalidArgument(f"--input {name}: cannot load '{path}': {exc}") from None
    return given


def _cmd_cleanup(args) -> int:
    from gepool.ipc import naming
    from gepool.ipc.sockets import runtime_dir

    removed = naming.cleanup_dead(dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for name in removed:
        print(f"{verb} /dev/shm/{name}")
    print(f"{verb} {len(removed)} segment(s)")
    folder = runtime_dir()
    stale = naming.cleanup_runtime(folder, dry_run=args.dry_run)
    if stale:
        print(f"{verb} {len(stale)} stale socket/FIFO file(s) in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
