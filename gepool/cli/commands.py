"""The client commands: status, infer, load, unload; and cleanup, which needs no pool."""

import argparse
import json

import numpy as np

from gepool.cli.args import UsageError, add_endpoint, load_inputs
from gepool.cli.connect import connect


def add_status(p: argparse.ArgumentParser) -> None:
    add_endpoint(p)
    p.add_argument("--json", action="store_true", help="print the pool's whole status as JSON")


def add_infer(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the model's name")
    p.add_argument("--input", action="append", default=[], metavar="NAME=FILE.npy",
                   help="send this input from a .npy file (repeatable); the others are random")
    p.add_argument("--batch-size", type=int, default=1, help="rows of the random inputs (default 1)")
    add_endpoint(p)
    p.add_argument("--shared-memory", action="store_true", help="pass tensors through a shared-memory arena")


def add_control(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="the model's name (its folder in the repository)")
    add_endpoint(p)


def add_cleanup(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")


def status(args) -> int:
    with connect(args.endpoint) as c:
        answer = c.status()
    print(json.dumps(answer, indent=2) if args.json else format_status(answer))
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


def infer(args) -> int:
    from gepool.bench.load import make_inputs

    given = load_inputs(args.input)
    with connect(args.endpoint, shared_memory=args.shared_memory) as c:
        meta = c.model_metadata(args.model)
        names = [t["name"] for t in meta.get("inputs", [])]
        unknown = sorted(set(given) - set(names))
        if unknown:
            raise UsageError(f"model '{args.model}' has no input {', '.join(unknown)} (its inputs: "
                             f"{', '.join(names)})")
        outputs = c.infer(args.model, dict(make_inputs(meta, args.batch_size), **given))
    for name, arr in outputs.items():
        print(f"{name} {arr.dtype} {list(arr.shape)}")
        print(np.array2string(arr, threshold=20, edgeitems=3))
    return 0


def load(args) -> int:
    with connect(args.endpoint) as c:
        print(json.dumps(c.load(args.model)))
    return 0


def unload(args) -> int:
    with connect(args.endpoint) as c:
        print(json.dumps(c.unload(args.model)))
    return 0


def cleanup(args) -> int:
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
