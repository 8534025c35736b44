"""What ``gepool bench`` tells a person while it runs: a live progress line, then one line per level."""

import threading
from dataclasses import dataclass

from gepool.bench.results import Level, level_label


@dataclass
class Progress:
    """A running level so far, for a live display."""
    mode: str
    level: float
    seconds: float  # the level's length
    elapsed: float
    sent: int | None  # None with several client processes: ``ok`` and ``errors`` are then the server's counts
    ok: int
    errors: int
    rps: float  # answers per second since the previous report
    p50_ms: float | None = None  # over the latest answers (this process's)
    p99_ms: float | None = None
    processes: int = 1


class Display:
    """What ``bench`` tells as it runs (the CLI prints it; the default says nothing)."""

    def tick(self, progress: Progress) -> None:
        pass

    def finished(self, level: Level, again_with: int = 0) -> None:
        """A level ended; ``again_with``: its client side was saturated and it runs again with this
        many client processes."""

    def note(self, text: str) -> None:
        """A line about what comes next (a sweep's setting)."""


class TerminalDisplay(Display):
    """Progress for a person: on a terminal, one line rewritten in place while a level runs; then, on a
    terminal or not (a log, a pipe), one line per level that stays."""

    def __init__(self, stream, live: bool | None = None) -> None:
        self.stream = stream
        self.live = stream.isatty() if live is None else live
        self.width = 0  # of the line being rewritten
        self.lock = threading.Lock()  # the ticker's thread and the caller's both write

    def tick(self, progress: Progress) -> None:
        if not self.live:
            return
        text = format_progress(progress)
        with self.lock:
            self.stream.write("\r" + text.ljust(self.width))
            self.stream.flush()
            self.width = max(self.width, len(text))

    def finished(self, level: Level, again_with: int = 0) -> None:
        label = level_label(level.mode, level.level)
        lat = level.latency_ms
        text = (f"{label:>10s}  {level.throughput_rps:.1f} req/s, p50 {lat['p50']:.2f} ms, p99 {lat['p99']:.2f} ms"
                if lat else f"{label:>10s}  no answer")
        failed = sum(level.errors.values())
        if failed:
            text += f", {failed} failed"
        if again_with:
            text += f"; the client side was saturated: again with {again_with} client processes"
        elif level.client_saturated:
            text += "; the client side was saturated"
        self.note(text)

    def note(self, text: str) -> None:
        with self.lock:
            if self.width:
                self.stream.write("\r" + " " * self.width + "\r")
                self.width = 0
            self.stream.write(text + "\n")
            self.stream.flush()


def format_progress(p: Progress) -> str:
    label = level_label(p.mode, p.level)
    counts = (f"sent {p.sent}  ok {p.ok}  failed {p.errors}" if p.sent is not None
              else f"server answered {p.ok}  failed {p.errors}")
    lat = f"  p50 {p.p50_ms:.2f} ms  p99 {p.p99_ms:.2f} ms" if p.p50_ms is not None else ""
    procs = f"  [{p.processes} client processes]" if p.processes > 1 else ""
    return f"{label:>10s}  {min(p.elapsed, p.seconds):5.1f}/{p.seconds:g}s  {counts}  {p.rps:8.0f} req/s{lat}{procs}"
