"""Log lines a peer can cause: at most one per cause and peer each period, with a count of those held back."""

import logging
import time
from collections.abc import Callable, Hashable

PERIOD_S = 10.0
# (cause, peer) pairs remembered; past it, new peers share one entry per cause, so that a flood from
# many identities (a ZMQ client may reconnect under a new one at will) is bounded too
MAX_PEERS = 256


class Limited:
    """``logger``'s lines, each at most once per ``period_s`` for one (cause, peer)."""

    def __init__(self, logger: logging.Logger, period_s: float = PERIOD_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.period_s, self.clock = logger, period_s, clock
        self._seen: dict[tuple, list] = {}  # (cause, peer) -> [quiet until, lines held back since]

    def log(self, level: int, cause: str, peer: Hashable, msg: str, *args) -> None:
        now = self.clock()
        key = (cause, peer)
        entry = self._seen.get(key)
        if entry is None and len(self._seen) >= MAX_PEERS:
            self._prune(now)
            if len(self._seen) >= MAX_PEERS:
                key = (cause, None)
                entry = self._seen.get(key)
                msg = "(one of many peers) " + msg
        if entry is not None and now < entry[0]:
            entry[1] += 1
            return
        held = entry[1] if entry is not None else 0
        self._seen[key] = [now + self.period_s, 0]
        if held:
            msg += " (and %d more like it in the last %.0f s, not logged)"
            args += (held, self.period_s)
        self.logger.log(level, msg, *args)

    def _prune(self, now: float) -> None:
        for key in [k for k, (until, _) in self._seen.items() if until <= now]:
            del self._seen[key]
