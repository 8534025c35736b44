"""The ``gepool`` command: start, status, infer, load, unload, bench, cleanup."""

import argparse
import json
import logging
import os
import socket
import sys

import numpy as np

import gepool
from gepool.common import errors

log = logging.getLogger("gepool.cli")

USAGE_EXIT = 2  # the command line is wrong, or names a file, folder or endpoint that is not there
FAILED_EXIT = 1  # the pool refused or failed what was asked
INTERRUPTED_EXIT = 130
PROBE_TIMEOUT_S = 5.0  # a tcp endpoint that does not accept a connection in this long is not listening
ENDPOINT_FORMS = "ipc://PATH, tcp://HOST:PORT or HOST:PORT"


class UsageError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line is one line on stderr (UsageError), not usage and a paragraph."""

    def error(self, message: str):
        raise UsageError(f"{message} (see '{self.prog} --help')")


def boolean(text: str) -> bool:
    """A boolean flag's value as tritonserver reads one: true/on/1 or false/off/0, any case."""
    low = text.lower()
    if low in ("true", "on", "1"):
        return True
    if low in ("false", "off", "0"):
        return False
    raise argparse.ArgumentTypeError(f"takes true or false, not '{text}'")


def verbosity(text: str) -> int:
    """--log-verbose: a level >= 0, or true/false (1/0), as tritonserver's."""
    low = text.lower()
    if low in ("true", "false"):
        return int(low == "true")
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"takes a level (0: off, 1 or more: verbose) or true/false, not '{text}'")
    return int(text)


def endpoint(text: str) -> str:
    """ipc://PATH or tcp://HOST:PORT as given; HOST:PORT becomes tcp://HOST:PORT."""
    if text.startswith("ipc://") and len(text) > len("ipc://"):
        return text
    rest = text.removeprefix("tcp://")
    host, sep, port = rest.rpartition(":")
    if sep and host and (port.isdigit() and 0 < int(port) < 65536 or port == "*"):
        return f"tcp://{rest}"
    raise argparse.ArgumentTypeError(f"an endpoint looks like {ENDPOINT_FORMS}, not '{text}'")


def processes(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"takes a whole number >= 1 or 'auto', not '{text}'")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    from gepool.bench import command as bench_command

    parser = _Parser(prog="gepool", description="A dynamically batching serving pool for deep-learning models.")
    parser.add_argument("--version", action="version", version=f"gepool {gepool.__version__}",
                        help="print gepool's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do ('gepool COMMAND --help' says more)")
    _start_arguments(sub.add_parser("start", help="serve a model repository in the foreground",
                                    description="Serve a model repository until SIGINT or SIGTERM."))

    p = sub.add_parser("status", help="a running pool's models and their states",
                       description="Show a running pool's models and their states.")
    _endpoint_argument(p)
    p.add_argument("--json", action="store_true", help="print the pool's whole status as JSON")

    p = sub.add_parser("infer", help="send one request (random inputs unless given)",
                       description="Send one request and print its outputs.")
    p.add_argument("model", help="the model's name")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="send this input from a .npy file (repeatable); the others are random")
    p.add_argument("--batch-size", type=int, default=1, help="rows of the random inputs (default 1)")
    _endpoint_argument(p)
    p.add_argument("--shared-memory", action="store_true", help="pass tensors through a shared-memory arena")

    for action in ("load", "unload"):
        p = sub.add_parser(action, help=f"{action} a model (pools started with --model-control-mode explicit)",
                           description=f"Ask a running pool to {action} a model.")
        p.add_argument("model", help="the model's name (its folder in the repository)")
        _endpoint_argument(p)

    bench_command.add_arguments(sub.add_parser(
        "bench", help="load a model at concurrency levels or Poisson rates; latency and throughput",
        description="Load a running pool's model and report latency, throughput and the server's view."))

    p = sub.add_parser("cleanup", help="remove shared-memory segments and files left by dead pools",
                       description="Remove shared-memory segments and runtime files left by dead pools.")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    return parser


def _endpoint_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", type=endpoint, metavar="ENDPOINT",
                   help=f"the pool's endpoint: {ENDPOINT_FORMS} (default: ipc in your runtime folder)")


def _start_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", "--model-store", dest="model_repository", action="append", required=True,
                   metavar="DIR", help="folder of <model>/config.pbtxt and <model>/<version>/ (--model-store: "
                                       "the same, as tritonserver's)")
    p.add_argument("--endpoint", type=endpoint, metavar="ENDPOINT",
                   help=f"where clients reach the pool: {ENDPOINT_FORMS}, tcp port * for a free one "
                        "(default: ipc in your runtime folder)")
    p.add_argument("--cpu-threads", type=int, default=0,
                   help="onnxruntime threads per CPU model, split among its instances (default: every core)")
    p.add_argument("--exit-on-error", type=boolean, default=True, metavar="BOOL",
                   help="true (default): exit non-zero, listing them, if models fail to load at start; "
                        "false: serve the others")
    p.add_argument("--strict-readiness", type=boolean, default=True, metavar="BOOL",
                   help="true (default): /v2/health/ready is ready only when every model is; "
                        "false: whenever the pool answers")
    p.add_argument("--allow-http", type=boolean, default=True, metavar="BOOL",
                   help="serve the KServe v2 HTTP protocol (default true)")
    p.add_argument("--http-port", type=int, default=8000, help="KServe v2 HTTP port (default 8000; 0: off)")
    p.add_argument("--http-host", default="127.0.0.1", help="address the HTTP and metrics ports bind (default "
                                                             "127.0.0.1)")
    p.add_argument("--allow-metrics", type=boolean, default=True, metavar="BOOL",
                   help="serve Prometheus metrics (default true)")
    p.add_argument("--metrics-port", type=int, default=8002, help="Prometheus /metrics port (default 8002; 0: off)")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], type=str.upper,
                   help="the least severe messages logged (default INFO); or Triton's --log-* flags")
    p.add_argument("--log-verbose", type=verbosity, metavar="N", help="1 or more: log verbose (debug) messages too")
    for level in ("info", "warning", "error"):
        p.add_argument(f"--log-{level}", type=boolean, metavar="BOOL", help=f"log {level} messages (default true)")
    p.add_argument("--model-control-mode", choices=["none", "explicit", "poll"], default="none",
                   help="none (default): serve the repository as started; explicit: load/unload on request; "
                        "poll: follow the repository's changes")
    p.add_argument("--load-model", action="append", default=[], metavar="NAME",
                   help="explicit mode: a model to load at start (repeatable)")
    p.add_argument("--repository-poll-secs", type=float, default=15.0,
                   help="poll mode: seconds between scans (default 15)")
    p.add_argument("--exit-timeout-secs", type=float, default=0.0,
                   help="on SIGTERM, report not ready but keep serving this long before draining (default 0)")
    p.add_argument("--curve-secret-key", metavar="FILE",
                   help="ZMQ certificate file: CURVE encryption and authentication for a tcp endpoint")
    p.add_argument("--curve-authorized-keys", metavar="DIR",
                   help="folder of client .key files admitted over CURVE (default: any key)")
    p.add_argument("--busy-poll-us", type=int, default=0,
                   help="0 (default): while traffic is sequential the front polls, instead of sleeping, "
                        "for what is due within microseconds; N > 0: polls N us before any sleep; -1: never polls")


def main(argv: list[str] | None = None) -> int:
    command = "gepool"
    try:
        args = build_parser().parse_args(argv)
        command = args.command
        return globals()[f"_cmd_{args.command}"](args)
    except UsageError as exc:
        _say(exc)
        return USAGE_EXIT
    except errors.GepoolError as exc:
        _say(exc)
        return FAILED_EXIT
    except KeyboardInterrupt:
        print(f"gepool {command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT


def _say(exc: Exception) -> None:
    print(f"gepool: error: {' '.join(str(exc).split())}", file=sys.stderr)  # one line, whatever it holds


# -- start ---------------------------------------------------------------------------------
class _LoadFailed(Exception):
    """Models failed to load at start with --exit-on-error: raised out of the ready callback, so the
    front shuts down through its own clean-up before the command exits."""


def log_threshold(args) -> int:
    """The least severe level logged, from --log-level or tritonserver's --log-* flags (which turn levels
    on and off; here a level can only be off with every less severe one, since logging is by threshold)."""
    triton = {"--log-verbose": args.log_verbose, "--log-info": args.log_info, "--log-warning": args.log_warning,
              "--log-error": args.log_error}
    given = [flag for flag, value in triton.items() if value is not None]
    if args.log_level:
        if given:
            raise UsageError(f"--log-level sets what {', '.join(given)} set: give one or the other")
        return logging.getLevelName(args.log_level)
    on = [(bool(args.log_verbose), "--log-verbose", logging.DEBUG)] + [
        (value is not False, flag, level) for (flag, value), level in
        zip(list(triton.items())[1:], (logging.INFO, logging.WARNING, logging.ERROR))]
    for (lower, lower_flag, _), (higher, higher_flag, _) in zip(on, on[1:]):
        if lower and not higher:
            raise UsageError(f"{lower_flag} with {higher_flag} false: gepool logs every level from the least "
                             f"severe one on, so {higher_flag} false needs the less severe levels off too")
    return next((level for enabled, _, level in on if enabled), logging.CRITICAL)


def _cmd_start(args) -> int:
    from gepool.ipc.sockets import default_endpoint
    from gepool.pool import serve

    if len(args.model_repository) > 1:
        raise UsageError("gepool serves one model repository: --model-repository (or --model-store) was given "
                         f"{len(args.model_repository)} times")
    repository = args.model_repository[0]
    if not os.path.isdir(repository):
        raise UsageError(f"--model-repository '{repository}' is not a folder")
    for flag, path, want in (("--curve-secret-key", args.curve_secret_key, os.path.isfile),
                             ("--curve-authorized-keys", args.curve_authorized_keys, os.path.isdir)):
        if path and not want(path):
            raise UsageError(f"{flag} '{path}' is not a {'file' if want is os.path.isfile else 'folder'}")
    level = log_threshold(args)
    logging.basicConfig(level=level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    endpoint = args.endpoint or default_endpoint()
    http_port = args.http_port if args.allow_http else 0
    metrics_port = args.metrics_port if args.allow_metrics else 0
    log.debug("serving %s on %s: http port %s, metrics port %s, strict readiness %s, exit on error %s",
              repository, endpoint, http_port or "off", metrics_port or "off", args.strict_readiness,
              args.exit_on_error)

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
        if status.get("metrics"):
            print(f"metrics on {status['metrics']}", flush=True)
        print(f"gepool ready on {status['endpoint']}", flush=True)

    print(f"gepool starting on {endpoint}", flush=True)
    try:
        return serve(repository, endpoint, cpu_threads=args.cpu_threads, log_level=level, on_ready=ready,
                     http_port=http_port, http_host=args.http_host, metrics_port=metrics_port,
                     curve_secret_key=args.curve_secret_key, curve_authorized_keys=args.curve_authorized_keys,
                     exit_grace_s=args.exit_timeout_secs, model_control_mode=args.model_control_mode,
                     load_models=tuple(args.load_model), poll_secs=args.repository_poll_secs,
                     busy_poll_us=args.busy_poll_us, strict_readiness=args.strict_readiness)
    except _LoadFailed as exc:
        for name, reason in exc.args[0]:
            _say(f"model '{name}' failed to load: {reason}")
        print(f"gepool: {len(exc.args[0])} model(s) failed to load; stopped (--exit-on-error false serves the "
              "others)", file=sys.stderr)
        return FAILED_EXIT


def _failed_at_start(status: dict, args) -> list[tuple[str, str]]:
    """(name, reason) of each model asked for at start that is not serving: every model of the
    repository, or in explicit mode those named by --load-model."""
    asked = set(args.load_model) if args.model_control_mode == "explicit" else None
    return [(name, m["reason"] or m["state"]) for name, m in status["models"].items()
            if m["state"] == "UNAVAILABLE" and (asked is None or name in asked)]


# -- clients -------------------------------------------------------------------------------
def connect(target: str | None, **kwargs):
    """A Client of the pool at ``target`` (default: the default endpoint), or a UsageError saying that
    nothing listens there, at once rather than after the client's connect timeout."""
    from gepool.client import Client
    from gepool.ipc.sockets import default_endpoint, ipc_path

    target = target or default_endpoint()
    path = ipc_path(target)
    if path is not None:
        if not os.path.exists(path):
            raise UsageError(f"no pool on {target}: {path} does not exist (start one with 'gepool start', "
                             "or give its --endpoint)")
        probe(path, f"no pool listens on {target}")
    else:
        host, _, port = target.removeprefix("tcp://").rpartition(":")
        probe((host.strip("[]"), int(port)), f"no pool listens on {target}")
    try:
        return Client(target, **kwargs)
    except errors.PoolUnavailable as exc:
        raise UsageError(f"no pool answers on {target}: {exc}") from None


def probe(address, why: str) -> None:
    """Raises UsageError(why: ...) unless something accepts a connection at ``address`` (a Unix socket
    path, or (host, port))."""
    family = socket.AF_UNIX if isinstance(address, str) else socket.AF_INET6 if ":" in address[0] \
        else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.settimeout(PROBE_TIMEOUT_S)
        try:
            s.connect(address)
        except OSError as exc:
            raise UsageError(f"{why}: {exc.strerror or exc}") from None


def load_inputs(items: list[str]) -> dict[str, np.ndarray]:
    """--input NAME=FILE.npy, each loaded now, so that a typo is an error before anything is sent."""
    given = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise UsageError(f"--input takes NAME=FILE.npy, not '{item}'")
        try:
            given[name] = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--input {name}: cannot load '{path}': {exc}") from None
    return given


def _cmd_status(args) -> int:
    with connect(args.endpoint) as c:
        status = c.status()
    print(json.dumps(status, indent=2) if args.json else format_status(status))
    return 0


def format_status(status: dict) -> str:
    """A pool's status for a person: where it serves, then a row per model."""
    head = (f"pool {status['pool_id']} on {status['endpoint']} (pid {status['pid']}), model control "
            f"{status.get('model_control_mode', 'none')}, polling {status.get('polling', {}).get('mode', '-')}"
            + (", stopping" if status.get("stopping") else ""))
    rows = [("MODEL", "STATE", "VERSION", "WORKERS", "QUEUED", "RESTARTS", "REASON")]
    for name, m in sorted(status["models"].items()):
        rows.append((name, m["state"], "-" if m.get("version") is None else str(m["version"]),
                     f"{m.get('ready_workers', 0)}/{m.get('workers', 0)}", str(m.get("queued", 0)),
                     str(m.get("restarts", 0)), m.get("reason") or ""))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = [head] + ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    if len(rows) == 1:
        lines.append("(no models)")
    return "\n".join(line.rstrip() for line in lines)


def _cmd_infer(args) -> int:
    from gepool.ipc import dtypes

    given = load_inputs(args.input)
    with connect(args.endpoint, shared_memory=args.shared_memory) as c:
        meta = c.model_metadata(args.model)
        unknown = sorted(set(given) - {t["name"] for t in meta.get("inputs", [])})
        if unknown:
            raise UsageError(f"model '{args.model}' has no input {', '.join(unknown)} (its inputs: "
                             f"{', '.join(t['name'] for t in meta.get('inputs', []))})")
        inputs = {}
        rng = np.random.default_rng(0)
        for t in meta.get("inputs", []):
            if t["name"] in given:
                inputs[t["name"]] = given[t["name"]]
                continue
            shape = [args.batch_size if i == 0 and meta["max_batch_size"] > 0 else (d if d > 0 else 1)
                     for i, d in enumerate(t["shape"])]
            inputs[t["name"]] = (rng.random(shape) * 10).astype(dtypes.to_numpy(t["datatype"]))
        outputs = c.infer(args.model, inputs)
    for name, arr in outputs.items():
        print(f"{name} {arr.dtype} {list(arr.shape)}")
        print(np.array2string(arr, threshold=20, edgeitems=3))
    return 0


def _cmd_load(args) -> int:
    with connect(args.endpoint) as c:
        print(json.dumps(c.load(args.model)))
    return 0


def _cmd_unload(args) -> int:
    with connect(args.endpoint) as c:
        print(json.dumps(c.unload(args.model)))
    return 0


def _cmd_bench(args) -> int:
    from gepool.bench import command

    return command.run(args)


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
    # `python -m gepool.cli` runs this file as __main__; gepool.bench.command imports gepool.cli, a second
    # copy with its own UsageError, so run the imported module's main for one set of classes
    from gepool.cli import main as _main

    sys.exit(_main())
