"""A model name as the front serves it: the versions in service, a generation loading, old ones draining.

A (re)load starts a new generation of every selected version beside the one serving; when all of
them have settled, the ready ones replace the serving set at once and the replaced ones drain
(their queued and running requests finish where they are) before their workers stop. If none
loads, the old generation keeps serving and the reason is kept.
"""

import random

from gepool.common import errors
from gepool.ipc import protocol
from gepool.scheduler.models import AVAILABLE, LOADING, UNAVAILABLE, Model
from gepool.scheduler.stats import ModelStats


def parse_split(text: str) -> dict[int, int]:
    """'2:90,3:10' -> {2: 90, 3: 10}: the share of unversioned requests each version gets."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        version, _, weight = part.partition(":")
        if not (version.isdigit() and weight.isdigit()):
            raise ValueError(f"traffic_split entries are VERSION:WEIGHT, got '{part}'")
        out[int(version)] = int(weight)
    return out


class Group:
    def __init__(self, name: str) -> None:
        self.name = name
        self.serving: dict[int, Model] = {}
        self.loading: list[Model] = []
        self.draining: list[Model] = []
        self.failed: list[Model] = []  # the last load's failures, for status
        self.error = ""
        self.waiters: list[tuple[bytes, int]] = []  # load requests answered when the load settles
        self.by_version: dict[int, ModelStats] = {}  # per version, across generations
        self.version_requests: dict[int, int] = {}
        self.unloading = False
        self.signature: tuple = ()
        self._rng = random.Random(0)

    @property
    def stats(self) -> ModelStats:
        """Across versions and generations: the sum of the versions' (each request is counted once)."""
        return ModelStats.summed(self.by_version.values())

    def version_stats(self, version: int | None) -> ModelStats:
        return self.by_version.setdefault(version if version is not None else 0, ModelStats())

    def stats_dict(self) -> dict:
        out = self.stats.as_dict()
        out["version_requests"] = {str(k): v for k, v in sorted(self.version_requests.items())}
        out["versions"] = {str(v): s.as_dict() for v, s in sorted(self.by_version.items())}
        return out

    def models(self) -> list[Model]:
        return [*self.serving.values(), *self.loading, *self.draining]

    def route(self, version: int) -> Model:
        """The model generation a request goes to: the version it names, or the default (a traffic split
        among ready versions when the config gives one, else the highest ready version)."""
        if self.unloading:
            raise errors.ModelNotFound(f"Request for unknown model: '{self.name}' is unloading")
        if version != protocol.NO_VERSION:
            model = self.serving.get(version)
            if model is None:
                raise errors.ModelNotFound(f"model '{self.name}' has no version {version} ready "
                                           f"(serving {sorted(self.serving) or 'none'})")
            return model
        if len(self.serving) == 1:  # the common case, on every request: no split to weigh
            (model,) = self.serving.values()
            if model.servable():
                return model
        ready = {v: m for v, m in self.serving.items() if m.servable()}
        if not ready:
            model = self.default() or (self.loading[0] if self.loading else None)
            if model is None:
                raise errors.ModelNotReady(f"model '{self.name}' is UNAVAILABLE: {self.error or 'not loaded'}")
            return model  # its check_servable says why it cannot take the request
        split = self._split(ready)
        if split:
            return ready[self._rng.choices(list(split), weights=list(split.values()))[0]]
        return ready[max(ready)]

    def default(self) -> Model | None:
        return self.serving[max(self.serving)] if self.serving else None

    def _split(self, ready: dict[int, Model]) -> dict[int, int]:
        text = ready[max(ready)].config.parameters.get("traffic_split", "")
        try:
            split = parse_split(text)
        except ValueError:
            return {}
        return {v: w for v, w in split.items() if v in ready and w > 0}

    def settle(self) -> tuple[list[Model], list[Model]] | None:
        """Once every loading generation is READY or UNAVAILABLE: swap the ready ones in. Returns
        (to drain, failed) or None while something still loads."""
        if not self.loading or any(m.state == LOADING for m in self.loading):
            return None
        ready = [m for m in self.loading if m.state == AVAILABLE]
        failed = [m for m in self.loading if m.state != AVAILABLE]
        self.loading = []
        self.failed = failed
        self.error = "; ".join(f"version {m.version}: {m.reason}" for m in failed)
        if not ready:
            return [], failed  # the old generation keeps serving
        old = list(self.serving.values())
        self.serving = {m.version: m for m in ready}
        self.draining += old
        return old, failed

    def state(self) -> str:
        if any(m.state == AVAILABLE or m.servable() for m in self.serving.values()):
            return AVAILABLE
        if self.loading or any(m.state == LOADING for m in self.serving.values()):
            return LOADING
        return UNAVAILABLE
