"""Python calls the front makes per request (cProfile of its main thread), independent of the host's load.

    python tools/front_calls.py [--zmq]

Serves the example 'tiny' model from a front in this process, sends 200 and then 2,200 sequential
requests from a client thread (lanes, or ZMQ with --zmq) in two fresh fronts, and prints the
difference of the two call counts per request. Busy polling is off and the housekeeping tick runs
only after non-hot events, so the count does not follow wall-clock time.
"""

import argparse
import cProfile
import importlib
import logging
import os
import pstats
import signal
import sys
import tempfile
import threading

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def calls(repo: str, requests: int, lane: bool) -> int:
    import gepool
    from gepool import pool
    from gepool.ipc import naming
    from gepool.scheduler.front import Front, FrontOptions

    for name in ("gepool.scheduler.loop", "gepool.scheduler.front"):
        mod = importlib.import_module(name)
        if hasattr(mod, "TICK_S"):
            mod.TICK_S = 1000.0
    endpoint = f"ipc://{tempfile.mkdtemp()}/front.sock"
    opts = FrontOptions(repository=repo, endpoint=endpoint, owner_id=naming.new_owner_id(), busy_poll_us=-1,
                        log_level=logging.WARNING)
    ready = threading.Event()

    def client() -> None:
        ready.wait()
        x = np.ones((1, 16), np.float32)
        try:
            with gepool.Client(endpoint, lane=lane) as c:
                for _ in range(requests):
                    c.infer("tiny", {"INPUT0": x})
        finally:
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    prof = cProfile.Profile()
    prof.enable()
    Front(opts, pool.start_worker, lambda status: ready.set(), place=pool.place_workers).run()
    prof.disable()
    thread.join()
    return pstats.Stats(prof).total_calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--zmq", action="store_true", help="the client talks ZMQ, not lanes")
    args = parser.parse_args()
    import make_models

    repo = tempfile.mkdtemp()
    make_models.make_tiny(repo)
    few, many = calls(repo, 200, not args.zmq), calls(repo, 2200, not args.zmq)
    print(f"{'zmq' if args.zmq else 'lanes'}: {(many - few) / 2000:.1f} calls per request "
          f"({few} for 200 requests, {many} for 2200)")


if __name__ == "__main__":
    main()
