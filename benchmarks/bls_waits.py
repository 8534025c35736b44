"""What the front's BLS wait-for check costs per call, in-process: the fast path and chains of waiting workers.

    python benchmarks/bls_waits.py [--seconds 2] [--depths 1,10,100]

Books and checks calls as the front does (scheduler/calls.py on real worker books; the models are stand-ins
with a real batcher). ``fast``: the callee has a worker with no batch waiting on a call, so no graph is
read. ``chain N``: the callee's only worker waits on a call to the next model, N models deep, the last one
free: the check reads the whole chain and admits the call. ``cycle N``: the same chain, but the last model's
worker waits on the caller: the check reads it and refuses the call. Each figure is the mean of
enter + forget (or the refusal) over --seconds.
"""

import argparse
import time
from types import SimpleNamespace

from gepool.common import errors
from gepool.scheduler.batcher import DynamicBatcher
from gepool.scheduler.books import Workers
from gepool.scheduler.calls import Calls
from gepool.scheduler.requests import Request
from gepool.scheduler.states import WorkerState


def _model(workers: Workers, name: str):
    model = SimpleNamespace(name=name, workers=[], batcher=DynamicBatcher(8), stats=None)
    w = workers.add(model, "cpu", 1, 2, 1 << 20)
    w.state, w.free = WorkerState.READY, [0, 1]
    model.workers.append(w)
    return model, w


def _request(name: str) -> Request:
    return Request(b"c", 0, name, [], [], 1, 0, None, -1, 0, 0, 0.0, chain=("x",))


def _batch(w, name: str) -> list:
    """``w`` runs a batch: the caller field its calls carry."""
    batch = w.take(1, [_request(name)], 1, False, 0.0)
    return [w.id, batch.slot, batch.seq]


def setup(depth: int, cycle: bool) -> tuple[Calls, object, list]:
    """models m0 .. m{depth}: m0 calls m1 (the call measured); m_i's worker waits on a call to m_{i+1}; the
    last is free, or (``cycle``) waits on a call back to m0."""
    workers = Workers()
    calls = Calls(workers, lambda *a: None, lambda *a: None, lambda *a: None)
    models = []
    for i in range(depth + 1):
        model, w = _model(workers, f"m{i}")
        models.append((model, w))
    callers = [_batch(w, m.name) for m, w in models]
    for i in range(1, depth):
        calls.enter(_request(f"m{i + 1}"), models[i + 1][0], callers[i])
    if cycle:
        calls.enter(_request("m0"), models[0][0], callers[depth])
    return calls, models[1][0], callers[0]


def measure(calls: Calls, target, caller: list, seconds: float) -> tuple[float, int]:
    """(µs per check, how many were refused of those made)."""
    n = refused = 0
    stop = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < stop:
        for _ in range(100):
            req = _request(target.name)
            try:
                calls.forget(calls.enter(req, target, caller))
            except errors.Unavailable:
                refused += 1
        n += 100
    return (time.perf_counter() - started) / n * 1e6, refused * 100 // n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="per measurement")
    parser.add_argument("--depths", default="1,10,100")
    args = parser.parse_args()
    workers = Workers()
    calls = Calls(workers, lambda *a: None, lambda *a: None, lambda *a: None)
    (_, caller), (target, _) = _model(workers, "a"), _model(workers, "b")
    us, _ = measure(calls, target, _batch(caller, "a"), args.seconds)
    print(f"{'case':12} {'us/call':>8} {'refused %':>9}")
    print(f"{'fast':12} {us:8.2f} {0:9d}")
    for depth in (int(d) for d in args.depths.split(",")):
        for cycle in (False, True):
            calls, target, caller = setup(depth, cycle)
            us, refused = measure(calls, target, caller, args.seconds)
            print(f"{('cycle ' if cycle else 'chain ') + str(depth):12} {us:8.2f} {refused:9d}")


if __name__ == "__main__":
    main()
