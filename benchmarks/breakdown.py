"""Where a tiny request's time goes at concurrency 1, in seven segments (method: benchmarks/README.md)."""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

SEGMENTS = ("client send -> front handler", "front handler -> slot filled", "slot filled -> worker started",
            "worker execute", "worker finished -> front completion", "front completion -> reply sent",
            "reply sent -> client returns")


def _front(out_path: str, argv: list[str]) -> int:
    """The front with two stamps added: its client handler's entry, and each completion's start/end."""
    import atexit

    from gepool import pool
    from gepool.scheduler import dispatch, front

    stamps: dict = {"in": [], "done": []}
    on_message, complete = front.Front._on_message, dispatch.Dispatcher.complete

    def stamped_on_message(self, identity, parts):  # from the ZMQ socket or a lane
        stamps["in"].append(time.monotonic())
        return on_message(self, identity, parts)

    def stamped_complete(self, model, w, index, seq):
        t0 = time.monotonic()
        _, _, _, times = w.ring.slots[index].result()
        complete(self, model, w, index, seq)
        stamps["done"].append((*times, t0, time.monotonic()))

    front.Front._on_message, dispatch.Dispatcher.complete = stamped_on_message, stamped_complete

    def dump() -> None:
        with open(out_path, "w") as f:
            json.dump(stamps, f)

    atexit.register(dump)
    return pool._front_process(argv)


def main() -> None:
    if sys.argv[1:2] == ["--front"]:
        sys.exit(_front(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--busy-poll-us", type=int, default=0)
    parser.add_argument("--zmq", action="store_true", help="the client talks ZMQ, not over a lane")
    args = parser.parse_args()

    import core

    import gepool.pool as gp

    stamps_path = os.path.join(tempfile.mkdtemp(), "front.json")
    real_popen = subprocess.Popen

    def popen(cmd, **kw):  # the Pool starts `python -m gepool.pool ARGS FD`: run the stamped front instead
        if cmd[1:3] == ["-m", "gepool.pool"]:
            cmd = [cmd[0], os.path.abspath(__file__), "--front", stamps_path, *cmd[3:]]
        return real_popen(cmd, **kw)

    gp.subprocess.Popen = popen
    x = np.ones((1, 16), np.float32)
    sent = []
    with gp.Pool(core.example_repo("gepool-breakdown-"), busy_poll_us=args.busy_poll_us) as pool:
        client = pool.client(lane=not args.zmq)
        for _ in range(300):
            client.infer("tiny", {"INPUT0": x})
        for _ in range(args.requests):
            t0 = time.monotonic()
            client.infer("tiny", {"INPUT0": x})
            sent.append((t0, time.monotonic()))
    gp.subprocess.Popen = real_popen
    with open(stamps_path) as f:
        stamps = json.load(f)
    seen, done = stamps["in"][-args.requests:], stamps["done"][-args.requests:]
    rows = []
    for (t_send, t_back), t_in, (t_filled, t_start, t_end, t_done, t_replied) in zip(sent, seen, done, strict=True):
        rows.append((t_in - t_send, t_filled - t_in, t_start - t_filled, t_end - t_start, t_done - t_end,
                     t_replied - t_done, t_back - t_replied))
    med = np.median(np.array(rows), axis=0) * 1e6
    print(f"tiny c=1, {args.requests} requests, busy poll {args.busy_poll_us} us, "
          f"{'ZMQ' if args.zmq else 'lane'} (medians)")
    for name, us in zip(SEGMENTS, med, strict=True):
        print(f"  {name:<38} {us:6.0f} us")
    total = np.median([b - s for s, b in sent]) * 1e6
    print(f"  {'total (median of the sums)':<38} {total:6.0f} us")


if __name__ == "__main__":
    main()
