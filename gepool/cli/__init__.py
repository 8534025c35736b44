"""The ``gepool`` command: start, status, infer, load, unload, bench, cleanup."""

import argparse
import sys

import gepool
from gepool.cli import commands, ray_serve, start
from gepool.cli.args import Parser, UsageError, say
from gepool.cli.commands import format_status
from gepool.cli.start import log_threshold
from gepool.common import errors

USAGE_EXIT = 2  # the command line is wrong, or names a file, folder or endpoint that is not there
FAILED_EXIT = 1  # the pool refused or failed what was asked
INTERRUPTED_EXIT = 130

__all__ = ["UsageError", "build_parser", "format_status", "log_threshold", "main"]


def build_parser() -> argparse.ArgumentParser:
    from gepool.bench import command as bench_command

    parser = Parser(prog="gepool", description="A dynamically batching serving pool for deep-learning models.")
    parser.add_argument("--version", action="version", version=f"gepool {gepool.__version__}",
                        help="print gepool's version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="what to do ('gepool COMMAND --help' says more)")
    subcommands = [
        ("start", start.add_arguments, start.run, "serve a model repository in the foreground",
         "Serve a model repository until SIGINT or SIGTERM."),
        ("status", commands.add_status, commands.status, "a running pool's models and their states",
         "Show a running pool's models and their states."),
        ("infer", commands.add_infer, commands.infer, "send one request (random inputs unless given)",
         "Send one request and print its outputs."),
        ("load", commands.add_control, commands.load, "load a model (pools started with --model-control-mode "
         "explicit)", "Ask a running pool to load or reload a model."),
        ("unload", commands.add_control, commands.unload, "unload a model (pools started with "
         "--model-control-mode explicit)", "Ask a running pool to unload a model."),
        ("bench", bench_command.add_arguments, bench_command.run,
         "load a model at concurrency levels or Poisson rates; latency and throughput",
         "Load a running pool's model and report latency, throughput and the server's view."),
        ("cleanup", commands.add_cleanup, commands.cleanup, "remove shared-memory segments and files left by "
         "dead pools", "Remove shared-memory segments and runtime files left by dead pools."),
        ("ray", ray_serve.add_arguments, ray_serve.run, "serve a repository with gepool replicas on Ray Serve",
         "Serve a model repository with gepool replicas on Ray Serve until SIGINT or SIGTERM."),
    ]
    for name, add, run, summary, description in subcommands:
        p = sub.add_parser(name, help=summary, description=description)
        add(p)
        p.set_defaults(run=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    command = "gepool"
    try:
        args = build_parser().parse_args(argv)
        command = f"gepool {args.command}"
        return args.run(args)
    except UsageError as exc:
        say(exc)
        return USAGE_EXIT
    except errors.GepoolError as exc:
        say(exc)
        return FAILED_EXIT
    except PermissionError as exc:  # a runtime folder or file another user made: says whose and how to fix it
        say(exc)
        return FAILED_EXIT
    except KeyboardInterrupt:
        print(f"{command}: interrupted", file=sys.stderr)
        return INTERRUPTED_EXIT
