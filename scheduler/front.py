"""The front process's entry: its options, and the loop that serves them (see loop.py, core.py)."""

from gepool.scheduler.loop import Loop as Front
from gepool.scheduler.options import FrontOptions

__all__ = ["Front", "FrontOptions"]
