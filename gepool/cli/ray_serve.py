"""``gepool ray``: a model repository served by N gepool replicas on Ray Serve, in the foreground."""

import argparse
import os
import signal
import sys
import threading

from gepool.cli.args import Parser, UsageError, say

STOP_POLL_S = 1.0
APP_NAME = "gepool"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model-repository", required=True, metavar="DIR",
                   help="folder of <model>/config.pbtxt and <model>/<version>/, on every node that runs a replica")
    p.add_argument("--replicas", type=_at_least(1), default=1, metavar="N",
                   help="replicas, each one pool (default 1); with --max-replicas, the fewest autoscaling keeps")
    p.add_argument("--max-replicas", type=_at_least(1), metavar="M",
                   help="autoscale between --replicas and M on requests in flight per replica")
    p.add_argument("--address", metavar="ADDRESS",
                   help="the Ray cluster to join ('auto': the one this node is part of; default: start a local one)")
    p.add_argument("--num-cpus", type=float, default=1.0, help="CPUs each replica reserves (default 1)")
    p.add_argument("--npus", type=float, default=0.0, help="Ray 'NPU' resources (Ascend) each replica reserves")
    p.add_argument("--gpus", type=float, default=0.0, help="GPUs each replica reserves")
    p.add_argument("--sizing-model", metavar="NAME",
                   help="the model whose batch size and instances set each replica's request limits "
                        "(default: the repository's largest)")
    p.add_argument("--http-host", default="127.0.0.1", help="address Serve's HTTP proxy binds (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000, help="Serve's HTTP proxy port (default 8000)")


def _at_least(least: int):
    def parse(text: str) -> int:
        if not text.isdigit() or int(text) < least:
            raise argparse.ArgumentTypeError(f"takes a whole number >= {least}, not '{text}'")
        return int(text)
    return parse


def application(args):
    """The Serve application the arguments describe (nothing starts)."""
    if not os.path.isdir(args.model_repository):
        raise UsageError(f"--model-repository '{args.model_repository}' is not a folder")
    try:
        from gepool.ray import build
    except ImportError as exc:
        raise UsageError(str(exc)) from None
    if args.max_replicas is not None and args.max_replicas < args.replicas:
        raise UsageError(f"--max-replicas {args.max_replicas} is below --replicas {args.replicas}")
    return build(args.model_repository, replicas=args.replicas, max_replicas=args.max_replicas,
                 num_cpus=args.num_cpus, npus=args.npus, gpus=args.gpus, sizing_model=args.sizing_model)


def run(args) -> int:
    app = application(args)
    import ray
    from ray import serve

    stop = threading.Event()
    ray.init(address=args.address, include_dashboard=False)
    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own SIGTERM handler
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.http_host, "port": args.http_port})
        serve.run(app, name=APP_NAME, route_prefix="/")
        scale = (f"{args.replicas} to {args.max_replicas}" if args.max_replicas else str(args.replicas))
        print(f"gepool on Ray Serve: {scale} replica(s) of {args.model_repository}; KServe v2 HTTP on "
              f"http://{args.http_host}:{args.http_port}, handle: serve.get_app_handle('{APP_NAME}')", flush=True)
        while not stop.wait(STOP_POLL_S):
            pass
        print("gepool ray: stopping (replicas drain)", flush=True)
        serve.delete(APP_NAME)  # each replica finishes its requests, then its pool drains and stops
        if args.address is None:
            serve.shutdown()
    finally:
        ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    from gepool.common import errors

    parser = Parser(prog="gepool ray", description="Serve a model repository with gepool replicas on Ray Serve.")
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except UsageError as exc:
        say(exc)
        return 2
    except errors.GepoolError as exc:
        say(exc)
        return 1


if __name__ == "__main__":
    sys.exit(main())
