"""A Serve application of gepool replicas, from Python (``build``) or a Serve config file (``app``)."""

import os

from ray.serve import Application

from gepool.common import errors
from gepool.ray.replica import GepoolReplica
from gepool.ray.sizing import autoscaling_config, sizing

# what a Serve config's ``args`` may hold: build()'s keywords, each checked, none ignored
ARGS = ("model_repository", "replicas", "max_replicas", "num_cpus", "npus", "gpus", "sizing_model", "cpu_threads",
        "health_check_period_s", "graceful_shutdown_timeout_s")


def build(model_repository: str, *, cpu_threads: int | None = None, **options) -> Application:
    """``replicas`` gepool replicas (with ``max_replicas``: autoscaled between the two), each reserving
    ``num_cpus`` CPUs, ``npus`` of Ray's ``NPU`` resource and ``gpus`` GPUs, and running its onnxruntime
    models on ``cpu_threads`` threads (default: ``num_cpus``); ``options``: deployment_options()'s."""
    deployment = deployment_options(model_repository, **options)
    num_cpus = deployment["ray_actor_options"]["num_cpus"]
    threads = cpu_threads if cpu_threads is not None else max(1, int(num_cpus))
    return GepoolReplica.options(**deployment).bind(os.path.abspath(model_repository), cpu_threads=threads)


def deployment_options(model_repository: str, *, replicas: int = 1, max_replicas: int | None = None,
                       num_cpus: float = 1, npus: float = 0, gpus: float = 0, sizing_model: str | None = None,
                       health_check_period_s: float | None = None, graceful_shutdown_timeout_s: float | None = None,
                       ) -> dict:
    """Serve's options for the gepool deployment: each replica takes at most ``max_ongoing_requests``,
    and autoscaling aims at ``target_ongoing_requests`` per replica (``gepool.ray.sizing``)."""
    if not os.path.isdir(model_repository):
        raise errors.InvalidArgument(f"model_repository '{model_repository}' is not a folder")
    for name, value, least in (("replicas", replicas, 1), ("num_cpus", num_cpus, 0), ("npus", npus, 0),
                               ("gpus", gpus, 0)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value < least:
            raise errors.InvalidArgument(f"{name} takes a number >= {least}, not {value!r}")
    size = sizing(model_repository, sizing_model)
    options: dict = {"max_ongoing_requests": size.max_ongoing_requests,
                     "ray_actor_options": {"num_cpus": num_cpus, "num_gpus": gpus,
                                           **({"resources": {"NPU": npus}} if npus else {})}}
    if max_replicas is None:
        options["num_replicas"] = replicas
    else:
        options["autoscaling_config"] = autoscaling_config(size, replicas, max_replicas)
    if health_check_period_s is not None:
        options["health_check_period_s"] = health_check_period_s
    if graceful_shutdown_timeout_s is not None:
        options["graceful_shutdown_timeout_s"] = graceful_shutdown_timeout_s
    return options


def app(args: dict) -> Application:
    """The application builder for a Serve config file (``import_path: gepool.ray:app``); ``args`` are
    build()'s keywords."""
    unknown = sorted(set(args) - set(ARGS))
    if unknown:
        raise errors.InvalidArgument(f"gepool.ray:app does not take {', '.join(unknown)} (it takes {', '.join(ARGS)})")
    if "model_repository" not in args:
        raise errors.InvalidArgument("gepool.ray:app needs args.model_repository")
    kwargs = dict(args)
    return build(kwargs.pop("model_repository"), **kwargs)
