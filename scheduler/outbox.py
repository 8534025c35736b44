"""The actions the core emits: the only way its decisions leave it (the loop performs them)."""

from typing import Protocol

from gepool.common.config import ModelConfig
from gepool.common.logsettings import LogSettings
from gepool.scheduler.books import Worker


class Outbox(Protocol):
    def place(self, config: ModelConfig) -> list[tuple[str, int]]:
        """The workers a model needs, as its backend places them: [(device, batches in flight)]; raises
        ConfigError for a placement the backend cannot run. (The face knows the backends; the core not.)"""

    def reply(self, identity: bytes, parts: list, copy: bool = False) -> None:
        """A message to a client, over the channel its identity came by; ``copy``: the parts point into
        a slot, reused once this returns (the lanes may hold them until the dispatcher's ``settle()``,
        which the loop binds to theirs)."""

    def spawn(self, w: Worker) -> None:
        """Starts the process of a worker the books hold as STARTING, with a fresh ring and doorbell
        (``w.ring``, ``w.bell``, ``w.process``), and watches its exit; the core then rings ``w.bell``
        to hand it batches."""

    def stop(self, w: Worker) -> None:
        """Asks a ready worker to finish what it runs and exit."""

    def kill(self, w: Worker) -> None:
        """Kills its process (hung, or retired while starting); its exit comes back as an event."""

    def drop_arena(self, w: Worker, name: str) -> None:
        """Tells a worker that maps client arenas to unmap one that was released."""

    def log_settings(self, settings: LogSettings) -> None:
        """Logs with these settings from now on: this process, every worker, and those started later."""

    def ready(self, status: dict) -> None:
        """Every worker of the first load has settled: the pool is ready (said once)."""
