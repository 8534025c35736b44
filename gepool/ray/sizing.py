"""How much one gepool replica takes in at once, from its repository: Serve's request limits and autoscaling.

A replica's pool keeps each model instance busy with one batch while it gathers the next (two slots per
batch in flight), so for the model that sizes the replica:

- ``target_ongoing_requests`` = max batch size x batches in flight: enough requests for every instance to
  run a full batch. Fewer leave batches short; more only wait in the pool's queue, so Serve adds a replica.
- ``max_ongoing_requests`` = twice that: a full batch running and the next one gathering, per instance.
  Past it, Serve's router holds requests back (or sends them to another replica) instead of piling them
  into one pool's queue.

A model without batching (max_batch_size 0) counts as batches of one. The repository's sizing model is
the one given, or else the model with the largest capacity.
"""

from dataclasses import dataclass

from gepool.common import errors

UPSCALE_DELAY_S = 10.0
DOWNSCALE_DELAY_S = 120.0  # a replica's pool takes seconds to load its models: scale down slowly


@dataclass(frozen=True)
class Sizing:
    model: str
    max_batch_size: int
    batches_in_flight: int

    @property
    def target_ongoing_requests(self) -> int:
        return max(1, self.max_batch_size) * self.batches_in_flight

    @property
    def max_ongoing_requests(self) -> int:
        return 2 * self.target_ongoing_requests


def sizing(repository: str, model: str | None = None) -> Sizing:
    """The Sizing of ``model`` (or of the repository's largest model); InvalidArgument names a model that
    is not there or whose config cannot be read."""
    from gepool.common.repository import scan
    from gepool.pool import place_workers

    sources = {src.name: src for src in scan(repository)}
    if model is not None and model not in sources:
        raise errors.InvalidArgument(f"sizing model '{model}' is not in the repository {repository} "
                                 f"(it holds {', '.join(sorted(sources)) or 'no model'})")
    found = []
    for name in [model] if model is not None else sorted(sources):
        config = sources[name].config
        if config is None:
            raise errors.InvalidArgument(f"model '{name}': {sources[name].error}")
        try:
            in_flight = sum(batches for _, batches in place_workers(config))
        except errors.ConfigError as exc:
            raise errors.InvalidArgument(str(exc)) from None
        found.append(Sizing(name, config.max_batch_size, in_flight))
    if not found:
        raise errors.InvalidArgument(f"the model repository {repository} holds no model")
    return max(found, key=lambda s: (s.target_ongoing_requests, s.model))


def autoscaling_config(size: Sizing, min_replicas: int, max_replicas: int) -> dict:
    """Serve's ``autoscaling_config``: between ``min_replicas`` and ``max_replicas``, aiming at
    ``size.target_ongoing_requests`` per replica."""
    if not 1 <= min_replicas <= max_replicas:
        raise errors.InvalidArgument(f"replicas: need 1 <= min ({min_replicas}) <= max ({max_replicas})")
    return {"min_replicas": min_replicas, "max_replicas": max_replicas,
            "target_ongoing_requests": size.target_ongoing_requests,
            "upscale_delay_s": UPSCALE_DELAY_S, "downscale_delay_s": DOWNSCALE_DELAY_S}
