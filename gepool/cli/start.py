"""``gepool start``: its options (tritonserver's common flags among them) and the foreground pool."""

import argparse
import logging
import os
import sys

from gepool.cli.args import ENDPOINT_FORMS, UsageError, boolean, byte_count, endpoint, say, tell, verbosity
from gepool.common.logsettings import FORMATS, LogSettings, log_to_file
from gepool.http.access import API_NAMES
from gepool.http.servers import DEFAULT_GRPC_SERVER, DEFAULT_HTTP_SERVER, GRPC_HELP, GRPC_SERVERS, HTTP_SERVERS
from gepool.http.servers import HELP as HTTP_SERVER_HELP
from gepool.options import DEFAULT, MODEL_CONTROL_MODES, OPTION_NAMES, PoolOptions
from gepool.scheduler.options import named_at_start

log = logging.getLogger("gepool.cli")
FAILED_EXIT = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags; each one that sets a pool option has that option's name (gepool/options.py) as its dest."""
    p.add_argument("--model-repository", "--model-store", dest="model_repository", action="append", required=True,
                   metavar="DIR", help="folder of <model>/config.pbtxt and <model>/<version>/ (--model-store: "
                                       "the same, as tritonserver's)")
    p.add_argument("--endpoint", type=endpoint, metavar="ENDPOINT",
                   help=f"where clients reach the pool: {ENDPOINT_FORMS}, tcp port * for a free one "
                        "(default: ipc in your runtime folder)")
    p.add_argument("--cpu-threads", type=int, default=DEFAULT.cpu_threads,
                   help="onnxruntime threads per CPU model, split among its instances (default: every core)")
    p.add_argument("--exit-on-error", type=boolean, default=True, metavar="BOOL",
                   help="true (default): exit non-zero, listing them, if models fail to load at start; "
                        "false: serve the others")
    p.add_argument("--strict-readiness", type=boolean, default=DEFAULT.strict_readiness, metavar="BOOL",
                   help="true (default): /v2/health/ready is ready only when every model is; "
                        "false: whenever the pool answers")
    p.add_argument("--strict-model-config", type=boolean, metavar="BOOL",
                   help="tritonserver's deprecated spelling: true is --disable-auto-complete-config, which wins")
    p.add_argument("--backend-config", dest="backend_config", action="append", default=[],
                   metavar="[BACKEND,]SETTING=VALUE",
                   help="as tritonserver's; gepool has default-max-batch-size (global or onnxruntime): the "
                        "max_batch_size auto-complete gives a model that can batch (default 4; 0: none); repeatable")
    p.add_argument("--model-config-name", metavar="NAME",
                   help="as tritonserver's: each model's configs/NAME.pbtxt where it has one, else its config.pbtxt")
    p.add_argument("--disable-auto-complete-config", dest="auto_complete_config", action="store_false",
                   help="as tritonserver's: no config is completed from its model file, so every model needs "
                        "a complete config.pbtxt (an ONNX model's is still checked against its file)")
    p.add_argument("--allow-http", type=boolean, default=True, metavar="BOOL",
                   help="serve the KServe v2 HTTP protocol (default true)")
    p.add_argument("--http-port", type=int, default=8000, help="KServe v2 HTTP port (default 8000; 0: off)")
    p.add_argument("--http-address", "--http-host", dest="http_host", default=DEFAULT.http_host, metavar="ADDRESS",
                   help=f"address the HTTP port binds, and the gRPC and metrics ports unless given theirs (default "
                        f"{DEFAULT.http_host}: tritonserver's is 0.0.0.0)")
    p.add_argument("--grpc-address", dest="grpc_host", default="", metavar="ADDRESS",
                   help="address the gRPC port binds (default: --http-address; tritonserver's is 0.0.0.0 whatever "
                        "its --http-address)")
    p.add_argument("--metrics-address", dest="metrics_host", default="", metavar="ADDRESS",
                   help="address the metrics port binds (default: --http-address, as tritonserver's)")
    p.add_argument("--http-restricted-api", action="append", default=[], metavar="API[,API...]:KEY=VALUE",
                   help="as tritonserver's (repeatable): requests to these HTTP APIs must carry header KEY with "
                        f"VALUE, else 403; APIs: {', '.join(API_NAMES)}")
    p.add_argument("--http-max-body-bytes", "--http-max-input-size", type=byte_count, default=0, metavar="N",
                   help="the largest HTTP request body, in bytes (413 above it; default: the largest slot of "
                        "the repository's models plus 1 MiB for the JSON header; --http-max-input-size: the "
                        "same, as tritonserver's)")
    p.add_argument("--http-server", choices=HTTP_SERVERS, default=DEFAULT_HTTP_SERVER, help=HTTP_SERVER_HELP)
    p.add_argument("--allow-grpc", type=boolean, default=True, metavar="BOOL",
                   help="serve Triton's KServe v2 gRPC protocol (default true)")
    p.add_argument("--grpc-port", type=int, default=8001,
                   help="KServe v2 gRPC port (default 8001; 0: off); binds --grpc-address")
    p.add_argument("--grpc-server", choices=GRPC_SERVERS, default=DEFAULT_GRPC_SERVER, help=GRPC_HELP)
    p.add_argument("--grpc-restricted-protocol", action="append", default=[], metavar="API[,API...]:KEY=VALUE",
                   help="as tritonserver's (repeatable): calls to these gRPC APIs must carry metadata "
                        "triton-grpc-protocol-KEY with VALUE, else UNAVAILABLE; the same APIs as "
                        "--http-restricted-api")
    p.add_argument("--sidecars", type=int, default=DEFAULT.sidecars, metavar="N",
                   help="sidecar processes serving the HTTP, gRPC and metrics ports together (each accepts "
                        "connections on the same sockets); default 0: one per 8 cores this process may run "
                        "on, 1 to 4 (1 with --http-server granian or --grpc-server grpcio, which bind their "
                        "own ports)")
    p.add_argument("--allow-metrics", type=boolean, default=True, metavar="BOOL",
                   help="serve Prometheus metrics (default true)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics port (default 8002; 0: off)")
    p.add_argument("--allow-cpu-metrics", dest="cpu_metrics", type=boolean, default=DEFAULT.cpu_metrics,
                   metavar="BOOL", help="Triton's nv_cpu_* gauges in /metrics (default true)")
    p.add_argument("--allow-gpu-metrics", type=boolean, metavar="BOOL",
                   help="as tritonserver's, false only: gepool has no GPU metrics (no GPU backend)")
    p.add_argument("--pinned-memory-pool-byte-size", type=int, metavar="BYTES",
                   help="as tritonserver's, 0 only: gepool has no pinned memory pool (Triton's needs GPU support)")
    p.add_argument("--cuda-memory-pool-byte-size", action="append", default=[], metavar="GPU:BYTES",
                   help="as tritonserver's, BYTES 0 only: gepool has no CUDA memory pool (no GPU backend)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], type=str.upper,
                   help="the least severe messages logged (default INFO); or tritonserver's --log-* flags")
    p.add_argument("--log-verbose", type=verbosity, metavar="N", help="1 or more: log verbose (debug) messages too")
    p.add_argument("--log-format", choices=FORMATS, default=DEFAULT.log_format,
                   help="as tritonserver's: ISO8601 stamps every process's log lines in UTC (default: default)")
    p.add_argument("--log-file", default=DEFAULT.log_file, metavar="PATH",
                   help="as tritonserver's: every process's log appended to PATH (created readable by this user "
                        "only) instead of the console")
    p.add_argument("--id", dest="server_id", default=DEFAULT.server_id, metavar="NAME",
                   help=f"the server's name in its metadata (HTTP GET /v2, gRPC ServerMetadata; default "
                        f"{DEFAULT.server_id}; tritonserver's is triton)")
    for level in ("info", "warning", "error"):
        p.add_argument(f"--log-{level}", type=boolean, metavar="BOOL", help=f"log {level} messages (default true)")
    p.add_argument("--model-control-mode", choices=MODEL_CONTROL_MODES, default=DEFAULT.model_control_mode,
                   help="none (default): serve the repository as started; explicit: load/unload on request; "
                        "poll: follow the repository's changes")
    p.add_argument("--load-model", dest="load_models", action="append", default=[], metavar="NAME",
                   help="explicit mode: a model to load at start (repeatable; '*' alone: every model)")
    p.add_argument("--repository-poll-secs", dest="poll_secs", type=float, default=DEFAULT.poll_secs, metavar="S",
                   help=f"poll mode: seconds between scans (default {DEFAULT.poll_secs:g})")
    p.add_argument("--exit-timeout-secs", dest="exit_grace_s", type=float, default=DEFAULT.exit_grace_s, metavar="S",
                   help="on SIGTERM, report not ready but keep serving this long before draining (default 0)")
    p.add_argument("--curve-secret-key", metavar="FILE",
                   help="ZMQ certificate file: CURVE encryption and authentication for a tcp endpoint")
    p.add_argument("--curve-authorized-keys", metavar="DIR",
                   help="folder of client .key files admitted over CURVE (default: any key)")
    p.add_argument("--max-queued-bytes", type=byte_count, default=DEFAULT.max_queued_bytes, metavar="N",
                   help="bytes of requests every model's queues may hold together; past it a request is answered "
                        "UNAVAILABLE (default: a quarter of the host's memory)")
    p.add_argument("--model-load-timeout-secs", dest="model_load_timeout_s", type=float,
                   default=DEFAULT.model_load_timeout_s, metavar="S",
                   help=f"a model still loading after S seconds is UNAVAILABLE, its worker killed "
                        f"(default {DEFAULT.model_load_timeout_s:g})")
    p.add_argument("--cache-config", dest="cache_size", type=_cache_config, default=0, metavar="local,size=BYTES",
                   help="Triton's local response cache of BYTES, for models with response_cache { enable: true }")
    p.add_argument("--busy-poll-us", type=int, default=DEFAULT.busy_poll_us,
                   help="0 (default): while traffic is sequential the front polls, instead of sleeping, "
                        "for what is due within microseconds; N > 0: polls N us before any sleep; -1: never polls")


def _cache_config(text: str) -> int:
    from gepool.scheduler.cache import parse_cache_config

    try:
        return parse_cache_config(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def pool_options(args: argparse.Namespace) -> PoolOptions:
    """The pool options of a ``gepool start`` command line: each flag whose dest names an option, then
    what several flags decide together."""
    from gepool.ipc.sockets import default_endpoint

    if args.allow_gpu_metrics:
        raise UsageError("--allow-gpu-metrics true: gepool has no GPU metrics (it has no GPU backend); leave the "
                         "flag out or set it false")
    if args.pinned_memory_pool_byte_size:
        raise UsageError(f"--pinned-memory-pool-byte-size {args.pinned_memory_pool_byte_size}: gepool has no pinned "
                         "memory pool (tritonserver allocates one only with GPU support, which gepool does not have); "
                         "leave the flag out or set it 0")
    for pool in args.cuda_memory_pool_byte_size:
        device, sep, size = pool.partition(":")
        if not (sep and device.isdecimal() and size.isdecimal() and pool.isascii()):
            raise UsageError(f"--cuda-memory-pool-byte-size option format is '<GPU device ID>:<pool byte size>'. "
                             f"Got {pool}")
        if int(size):
            raise UsageError(f"--cuda-memory-pool-byte-size {pool}: gepool has no CUDA memory pool (it has no GPU "
                             "backend); leave the flag out or set the size 0")
    if args.model_config_name == "":
        raise UsageError("empty argument for --model-config-name")  # tritonserver's words
    given = {name: value for name, value in vars(args).items() if name in OPTION_NAMES}
    given["model_config_name"] = args.model_config_name or ""
    given.update(repository=args.model_repository[0], endpoint=args.endpoint or default_endpoint(),
                 log_level=log_threshold(args), http_port=args.http_port if args.allow_http else 0,
                 metrics_port=args.metrics_port if args.allow_metrics else 0,
                 grpc_port=args.grpc_port if args.allow_grpc else 0,
                 auto_complete_config=_auto_complete(args))
    return PoolOptions(**given)


def _auto_complete(args: argparse.Namespace) -> bool:
    """--disable-auto-complete-config, or tritonserver's deprecated --strict-model-config (with its warnings)."""
    if args.strict_model_config is None:
        return args.auto_complete_config
    print("Warning: '--strict-model-config' has been deprecated! Please use '--disable-auto-complete-config' "
          "instead.", file=sys.stderr)
    if not args.auto_complete_config and not args.strict_model_config:
        print("Warning: Overriding deprecated '--strict-model-config' from False to True in favor of "
              "'--disable-auto-complete-config'!", file=sys.stderr)
    return args.auto_complete_config and not args.strict_model_config


class _LoadFailed(Exception):
    """Models failed to load at start with --exit-on-error: raised out of the ready callback, so the
    front shuts down through its own clean-up before the command exits."""


def log_threshold(args) -> int:
    """The least severe level logged, from --log-level or tritonserver's --log-* flags (which turn levels
    on and off; here a level can only be off with every less severe one, since logging is by threshold)."""
    flags = [("--log-verbose", bool(args.log_verbose), args.log_verbose, logging.DEBUG),
             ("--log-info", args.log_info is not False, args.log_info, logging.INFO),
             ("--log-warning", args.log_warning is not False, args.log_warning, logging.WARNING),
             ("--log-error", args.log_error is not False, args.log_error, logging.ERROR)]
    given = [flag for flag, _, value, _ in flags if value is not None]
    if args.log_level:
        if given:
            raise UsageError(f"--log-level sets what {', '.join(given)} set: give one or the other")
        return logging.getLevelName(args.log_level)
    for (lower, lower_on, _, _), (higher, higher_on, _, _) in zip(flags, flags[1:]):
        if lower_on and not higher_on:
            raise UsageError(f"{lower} with {higher} false: gepool logs every level from the least severe one "
                             f"on, so {higher} false needs the less severe levels off too")
    return next((level for _, on, _, level in flags if on), logging.CRITICAL)


def run(args) -> int:
    from gepool.pool import serve

    if len(args.model_repository) > 1:
        raise UsageError("gepool serves one model repository: --model-repository (or --model-store) was given "
                         f"{len(args.model_repository)} times")
    repository = args.model_repository[0]
    if not os.path.isdir(repository):
        raise UsageError(f"--model-repository '{repository}' is not a folder")
    for flag, path, want, what in (("--curve-secret-key", args.curve_secret_key, os.path.isfile, "file"),
                                   ("--curve-authorized-keys", args.curve_authorized_keys, os.path.isdir, "folder")):
        if path and not want(path):
            raise UsageError(f"{flag} '{path}' is not a {what}")
    options = pool_options(args)
    try:
        options.check()
    except (ValueError, OSError) as exc:
        raise UsageError(str(exc)) from None
    if options.log_file:  # this process is the front: serve() finds it done
        try:
            log_to_file(options.log_file)
        except OSError as exc:
            raise UsageError(f"--log-file '{options.log_file}' cannot be written: {exc.strerror or exc}") from None
    logging.basicConfig(level=options.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    LogSettings.of_level(options.log_level, options.log_format).apply()  # (this process is the front)
    log.debug("serving %s on %s: http port %s, metrics port %s, strict readiness %s, exit on error %s",
              repository, options.endpoint, options.http_port or "off", options.metrics_port or "off",
              options.strict_readiness, args.exit_on_error)

    def ready(status: dict) -> None:
        for name, m in status["models"].items():
            line = f"model {name}: {m['state']}"
            line += f" (version {m['version']}, {m['ready_workers']} worker(s))" if m["state"] == "READY" else ""
            line += f" - {m['reason']}" if m["reason"] else ""
            print(line, flush=True)
        failed = _failed_at_start(status, args)
        if failed and args.exit_on_error:
            raise _LoadFailed(failed)
        if status.get("http"):
            print(f"HTTP (KServe v2) on {status['http']}", flush=True)
        if status.get("grpc"):
            print(f"gRPC (KServe v2) on {status['grpc']}", flush=True)
        if status.get("metrics"):
            print(f"metrics on {status['metrics']}", flush=True)
        if status.get("sidecars"):
            print(f"{status['sidecars']} sidecar process(es) serve these ports (--sidecars)", flush=True)
        print(f"gepool ready on {status['endpoint']}", flush=True)

    print(f"gepool starting on {options.endpoint}", flush=True)
    try:
        return serve(options, on_ready=ready)
    except _LoadFailed as exc:
        (failed,) = exc.args
        for name, reason in failed:
            say(f"model '{name}' failed to load: {reason}")
        tell(f"gepool: {len(failed)} model(s) failed to load; stopped (--exit-on-error false serves the others)")
        return FAILED_EXIT


def _failed_at_start(status: dict, args) -> list[tuple[str, str]]:
    """(name, reason) of each model asked for at start that is not serving: every model of the
    repository, or in explicit mode those named by --load-model."""
    named = named_at_start(args.model_control_mode, args.load_models)
    asked = None if named is None else set(named)
    return [(name, m["reason"] or m["state"]) for name, m in status["models"].items()
            if m["state"] == "UNAVAILABLE" and (asked is None or name in asked)]
