"""Garbage collection in a long-running serving process: what start-up built is never scanned again."""

import gc


def settle() -> None:
    """Called once start-up is done, just before serving. Collects what start-up left, then moves every
    object still alive (modules, apps, routes, protobuf descriptors) to the permanent generation, so that
    a full collection while serving scans only objects made since: without it each one walked the whole
    start-up heap while every request on the event loop waited."""
    gc.collect()
    gc.freeze()
