"""Garbage collection in a long-running serving process: what start-up built is never scanned again."""

import gc

# Container allocations (net of deallocations) between two young collections; CPython's default is 700.
# Garbage in a reference cycle waits this much longer to be freed, with any buffer it holds: a request's
# path must not leave its body in a cycle (tests/test_body_cycles.py).
YOUNG_THRESHOLD = 20_000


def settle() -> None:
    """Called once start-up is done, just before serving. Collects what start-up left, then moves every
    object still alive (modules, apps, routes, protobuf descriptors) to the permanent generation, so that
    a full collection while serving scans only objects made since: without it each one walked the whole
    start-up heap while every request on the event loop waited."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_THRESHOLD, older, oldest)
