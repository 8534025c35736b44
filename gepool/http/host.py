"""The host's CPU utilization and memory from /proc, computed as Triton's CPU metrics compute them."""

import time

PROC_STAT = "/proc/stat"
PROC_MEMINFO = "/proc/meminfo"
MIN_INTERVAL_S = 1.0  # the shortest interval a reading starts anew from (a few jiffies would be noise)
_BUSY = (0, 1, 2, 5, 6, 7)  # user nice system irq softirq steal: the columns after "cpu" in /proc/stat
_IDLE = (3, 4)  # idle iowait


def cpu_times(path: str = PROC_STAT) -> tuple[int, int] | None:
    """(busy, idle) jiffies of all CPUs together since boot, or None when /proc/stat cannot say."""
    try:
        with open(path) as f:
            line = f.readline()
    except OSError:
        return None
    if not line.startswith("cpu "):
        return None
    try:
        values = [int(v) for v in line.split()[1:9]]
    except ValueError:
        return None
    values += [0] * (8 - len(values))
    return sum(values[i] for i in _BUSY), sum(values[i] for i in _IDLE)


def memory(path: str = PROC_MEMINFO) -> tuple[int, int]:
    """(total, used) bytes of RAM, used being MemTotal - MemAvailable as Triton has it; (0, 0) if unknown."""
    fields = {}
    try:
        with open(path) as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in ("MemTotal", "MemAvailable"):
                    fields[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    total, available = fields.get("MemTotal"), fields.get("MemAvailable")
    if total is None or available is None or available > total:
        return 0, 0
    return total, total - available


class CpuUtilization:
    """The share of CPU time spent busy ([0.0, 1.0]) since the start of the current interval, which
    begins when this is made and again at each reading at least MIN_INTERVAL_S after its start (so a
    scrape right after another still reports a second or more, not a few jiffies)."""

    def __init__(self, clock=time.monotonic, path: str = PROC_STAT) -> None:
        self.clock, self.path = clock, path
        self.since, self.at, self.value = cpu_times(path), clock(), 0.0

    def read(self) -> float:
        now, times = self.clock(), cpu_times(self.path)
        if times is None or self.since is None:
            self.since, self.at, self.value = times, now, 0.0
            return self.value
        busy, idle = (max(new - old, 0) for new, old in zip(times, self.since))
        if busy + idle:
            self.value = busy / (busy + idle)
        if now - self.at >= MIN_INTERVAL_S:
            self.since, self.at = times, now
        return self.value
