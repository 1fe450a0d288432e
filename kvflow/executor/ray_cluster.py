"""The Ray cluster as the Ray executor needs it (kvflow/executor/ray.py): Ray imported, the
cluster at ``RAY_ADDRESS`` joined or why not, one worker's resources, and whether the cluster
can hold them all. The engine's API process asks the same before it starts an engine core
(``engine/core_client.py``)."""

from __future__ import annotations

import logging
from typing import Any

from kvflow.config import EngineConfig

logger = logging.getLogger(__name__)


def import_ray() -> Any:
    """The ``ray`` module.

    Raises:
        ValueError: (one line) when Ray is not installed.
    """
    try:
        import ray
    except ImportError:
        raise ValueError("distributed_executor_backend='ray' needs Ray, which is not "
                         "installed: pip install 'kvflow[ray]'") from None
    return ray


def ray_connect_error(address: str, error: Exception) -> str:
    """Why the cluster at ``RAY_ADDRESS`` could not be joined, and the likely fixes."""
    first = str(error).strip().splitlines()
    return (f"cannot join the Ray cluster at RAY_ADDRESS={address}: "
            f"{first[0] if first else type(error).__name__} (is it running? A cluster "
            "`ray start` began with token authentication, its default in recent Ray, is "
            "joined with RAY_AUTH_MODE=token and its token in ~/.ray/auth_token or "
            "RAY_AUTH_TOKEN)")


def worker_bundle(ray: Any, config: EngineConfig) -> dict[str, int]:
    """The Ray resources of one worker: ``{"GPU": 1}`` on CUDA (or ``device="auto"`` on a
    cluster with GPUs), ``{"CPU": 1}`` otherwise."""
    device = config.device_config.device
    gpu = device == "cuda" or (device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    return {"GPU": 1} if gpu else {"CPU": 1}


def check_cluster_fits(ray: Any, bundle: dict[str, int], count: int, local: bool,
                       timeout_s: float) -> None:
    """Check that the connected Ray cluster has ``count`` workers' ``bundle`` in all (free
    or not). A ``local`` cluster (started by kvflow in this process: one machine, no
    autoscaler) never grows, so a shortfall is an error at once (was: the placement group
    waited ``placement_timeout_s``, 120 s, before the same error); another cluster may grow
    (an autoscaler): a warning, and the placement waits.

    Raises:
        ValueError: naming the shortfall and what to do, if ``local`` and it cannot fit.
    """
    (key, per), = bundle.items()
    have = ray.cluster_resources().get(key, 0)
    if have >= per * count:
        return
    what = (f"the Ray cluster has {have:g} {key} in all, fewer than the {count} workers of "
            f"{bundle} need")
    if local:
        raise ValueError(f"{what}; kvflow started it on this machine, where Ray counts "
                         f"{have:g}: start a cluster with enough (ray start --head "
                         f"--num-{key.lower()}s {per * count}) and name it in RAY_ADDRESS")
    logger.warning("%s; waiting up to %.0f s for it to grow", what, timeout_s)
