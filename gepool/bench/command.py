"""The ``gepool bench`` subcommand: its options, and the checks that refuse what it would ignore."""

import argparse
import json
import os
import sys

from gepool.cli.args import UsageError, add_endpoint, load_inputs, processes
from gepool.cli.connect import connect, probe
from gepool.common import errors

DEFAULT_CONCURRENCY = [1, 2, 4, 8, 16]
DEFAULT_P99_TARGET_MS = 100.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the model's name")
    add_endpoint(p)
    p.add_argument("--http", metavar="URL", help="load the KServe v2 HTTP endpoint instead (e.g. localhost:8000)")
    p.add_argument("--concurrency", default="", help="closed-loop levels, e.g. 1,2,4,8,16 (the default, "
                                                       "without --rate)")
    p.add_argument("--rate", default="", help="open-loop Poisson arrival rates (requests/s), e.g. 100,200")
    p.add_argument("--duration", type=float, default=5.0, help="seconds per level (default 5)")
    p.add_argument("--batch-size", type=int, default=1, help="rows per request (default 1)")
    p.add_argument("--shared-memory", action="store_true",
                   help="a shared-memory client, as a user's would be: requests under 64 KiB still go as frames")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="send this data for an input (repeatable); the others are random")
    p.add_argument("--processes", type=processes, default="auto",
                   help="client processes sharing each level, or 'auto' (the default): one, doubled while "
                        "the client side is saturated")
    p.add_argument("--output", metavar="FILE", help="write the report as JSON here")
    p.add_argument("--plot", metavar="FILE", help="write a PNG of latency against throughput and batch sizes "
                                                 "(needs matplotlib: pip install 'gepool[plot]')")
    p.add_argument("--sweep", action="store_true",
                   help="try a grid of max_queue_delay_microseconds and instance counts on private pools")
    p.add_argument("--model-repository", metavar="DIR", help="--sweep: the repository holding MODEL")
    p.add_argument("--p99-target-ms", type=float,
                   help=f"--sweep: the p99 latency the setting must meet (default {DEFAULT_P99_TARGET_MS:g})")


def _levels(text: str, flag: str, kind) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} takes a comma-separated list of numbers, not '{text}'") from None
    if any(v <= 0 for v in values):
        raise UsageError(f"{flag} takes numbers above 0, not '{text}'")
    return values


def _refuse_what_would_be_ignored(args) -> None:
    if args.http or args.sweep:  # these load with one client process of their own: say so, not ignore
        other = "--http" if args.http else "--sweep"
        if args.shared_memory:
            raise UsageError(f"--shared-memory is the library client's carrier: it does not go with {other}")
        if args.processes not in ("auto", 1):
            raise UsageError(f"--processes splits the library client's load: it does not go with {other}")
    if args.http and args.endpoint:
        raise UsageError("--http loads the HTTP endpoint: it does not take --endpoint as well")
    if args.sweep:
        if args.http or args.endpoint or args.plot:
            raise UsageError("--sweep starts its own pools and prints a table: it does not take --http, --endpoint "
                             "or --plot")
        if not args.model_repository:
            raise UsageError("--sweep needs --model-repository (it starts its own pools)")
        if not os.path.isdir(os.path.join(args.model_repository, args.model)):
            raise UsageError(f"--model-repository '{args.model_repository}' has no folder '{args.model}'")
        from gepool.common.repository import CONFIG_NAME

        if not os.path.isfile(os.path.join(args.model_repository, args.model, CONFIG_NAME)):
            raise UsageError(f"--sweep varies the batching in the model's config.pbtxt, and '{args.model}' has none "
                             f"(its config is auto-completed): save the completed one (GET /v2/models/{args.model}"
                             f"/config shows it) as config.pbtxt and sweep again")
    elif args.model_repository or args.p99_target_ms is not None:
        raise UsageError("--model-repository and --p99-target-ms are for --sweep")
    if args.duration <= 0 or args.batch_size < 1:
        raise UsageError("--duration takes seconds above 0 and --batch-size a whole number >= 1")


def run(args) -> int:
    from gepool.bench import TerminalDisplay, bench, bench_http, format_report, plot, require_matplotlib

    concurrency = _levels(args.concurrency, "--concurrency", int)
    rates = _levels(args.rate, "--rate", float)
    if not concurrency and not rates:
        concurrency = DEFAULT_CONCURRENCY
    _refuse_what_would_be_ignored(args)
    given = load_inputs(args.input)
    if args.plot:
        try:
            require_matplotlib()  # before the run, not after minutes of load
        except errors.InvalidArgument as exc:
            raise UsageError(str(exc)) from None
    display = TerminalDisplay(sys.stderr)  # progress on stderr: stdout keeps the report
    if args.sweep:
        from gepool.bench import format_sweep, sweep

        target = DEFAULT_P99_TARGET_MS if args.p99_target_ms is None else args.p99_target_ms
        result = sweep(args.model_repository, args.model, concurrency, args.duration, target,
                       batch_size=args.batch_size, rates=rates, given=given, display=display)
        print(format_sweep(result))
        _write_json(args.output, result)
        return 0
    if args.http:
        url = args.http.rstrip("/") if "://" in args.http else f"http://{args.http.rstrip('/')}"
        probe(_host_port(url), f"nothing listens on {url}")
        report = bench_http(url, args.model, concurrency, rates, args.duration, args.batch_size, given, display)
    else:
        with connect(args.endpoint, shared_memory=args.shared_memory) as c:
            report = bench(c, args.model, concurrency, rates, args.duration, args.batch_size, args.processes,
                           given, display)
    print(format_report(report))
    _write_json(args.output, report)
    if args.plot:
        plot(report, args.plot)
        print(f"plot written to {args.plot}")
    return 0


def _host_port(url: str) -> tuple[str, int]:
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        host, port = parts.hostname, parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        host = None
    if not host:
        raise UsageError(f"--http takes HOST:PORT or http://HOST:PORT, not '{url}'")
    return host, port


def _write_json(path: str | None, report: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
