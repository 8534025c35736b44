"""Waiting on an NPU with a deadline: pyACL's timed wait where the SoC takes one, else a host-side watchdog."""

import logging
import threading
import time
from collections.abc import Callable, Hashable

from gepool.workers import aclconst as C

log = logging.getLogger("gepool.ge")

PROBE_TIMEOUT_MS = 5_000  # the probe's event is recorded on an idle stream: it completes at once


def probe_timed_waits(acl, stream: int, event: int) -> tuple[bool, str]:
    """Whether ``synchronize_event_with_timeout`` takes a timeout > 0 here, and why not if it does not.

    One timed wait on an event recorded on an idle stream: Ascend 310 (Atlas 200/300/500) accepts only -1
    and answers ACL_ERROR_RT_PARAM_INVALID, and some CANN releases lack the call altogether."""
    timed = getattr(acl.rt, "synchronize_event_with_timeout", None)
    if timed is None:
        return False, "this CANN release has no acl.rt.synchronize_event_with_timeout"
    ret = acl.rt.record_event(event, stream)
    if ret != C.SUCCESS:
        raise RuntimeError(f"acl.rt.record_event failed with {ret} while probing timed waits")
    ret = timed(event, PROBE_TIMEOUT_MS)
    if ret == C.SUCCESS:
        return True, ""
    acl.get_recent_err_msg()  # read once: the probe's error must not stick to a later failure's message
    acl.rt.synchronize_event(event)
    return False, f"acl.rt.synchronize_event_with_timeout({PROBE_TIMEOUT_MS} ms) answered {ret} on {acl.get_soc_name()}"


class Watchdog:
    """Deadlines armed by the threads that block in an untimed wait; its one thread calls ``expired(key)``
    for each deadline that passes before it is disarmed. ``expired`` runs on the watchdog's thread."""

    def __init__(self, expired: Callable[[Hashable], None]) -> None:
        self._expired = expired
        self._deadlines: dict[Hashable, float] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="ge-watchdog", daemon=True)
        self._thread.start()

    def arm(self, key: Hashable, timeout_s: float) -> None:
        with self._cond:
            self._deadlines[key] = time.monotonic() + timeout_s
            self._cond.notify()

    def disarm(self, key: Hashable) -> None:
        with self._cond:
            self._deadlines.pop(key, None)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                now = time.monotonic()
                due = [k for k, d in self._deadlines.items() if d <= now]
                for k in due:
                    del self._deadlines[k]
                if not due:
                    self._cond.wait(min(self._deadlines.values(), default=now + 3600) - now)
                    continue
            for k in due:  # outside the lock: expired() may arm or disarm
                try:
                    self._expired(k)
                except Exception:
                    log.exception("watchdog callback failed")

