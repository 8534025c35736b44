"""gepool replicas on Ray Serve (``pip install 'gepool[ray]'``): one pool per replica, batching inside it."""

try:
    from ray import serve as _serve  # noqa: F401
except ImportError as exc:
    raise ImportError(f"gepool.ray needs Ray Serve: pip install 'gepool[ray]' ({exc})") from None

from gepool.ray.app import app, build, deployment_options
from gepool.ray.replica import GepoolReplica
from gepool.ray.sizing import Sizing, autoscaling_config, sizing

__all__ = ["GepoolReplica", "Sizing", "app", "autoscaling_config", "build", "deployment_options", "sizing"]
