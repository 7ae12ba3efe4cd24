"""Everything of Ray this project uses, imported in one place, with a version check.

Ray Serve's request-router API (``ray.serve.request_router``) is alpha in 2.60: a change of
names or signatures there is fixed here only. Ray is an optional extra
(``pip install 'vllm-hybrid[cluster]'``); :func:`require_ray` says so when it is missing.
"""

from __future__ import annotations

import os
from typing import Any

#: The Ray release this code was written and tested against (pyproject's ``cluster`` extra).
RAY_VERSION = "2.60.0"
#: Set to 1 to run on another Ray release anyway (the request-router API may differ).
ENV_ANY_VERSION = "VLLM_HYBRID_RAY_ANY_VERSION"
MISSING = (
    "Ray Serve is not installed; the cluster mode (--replicas) needs it: "
    "pip install 'vllm-hybrid[cluster]' (ray[serve]==" + RAY_VERSION + ")"
)


class RayMissing(RuntimeError):
    """Ray (or Ray Serve) is not importable, or is a release we do not support."""


def require_ray() -> Any:
    """Import ``ray`` and ``ray.serve``; raises :class:`RayMissing` with the fix."""
    try:
        import ray
        import ray.serve  # noqa: F401
    except ImportError as error:
        raise RayMissing(f"{MISSING} ({error})") from None
    if ray.__version__ != RAY_VERSION and os.environ.get(ENV_ANY_VERSION) != "1":
        raise RayMissing(
            f"Ray {ray.__version__} is installed; vllm-hybrid's router is written for Ray "
            f"{RAY_VERSION}'s alpha request-router API: pip install 'ray[serve]=={RAY_VERSION}' "
            f"(or set {ENV_ANY_VERSION}=1 to try anyway)"
        )
    return ray


def request_router_class() -> type:
    """``ray.serve.request_router.RequestRouter``, the base class of ours."""
    require_ray()
    from ray.serve.request_router import RequestRouter

    return RequestRouter


def replica_key(replica: Any) -> str:
    """A ``RunningReplica``'s (or a ``ReplicaID``'s) stable id string."""
    replica_id = getattr(replica, "replica_id", replica)
    return str(replica_id.unique_id)


def replica_routing_stats(replica: Any) -> dict[str, Any]:
    """What a replica's ``record_routing_stats`` returned last (Ray pushes it to routers)."""
    return dict(getattr(replica, "routing_stats", None) or {})


def pending_args(pending_request: Any) -> list[Any]:
    return list(getattr(pending_request, "args", None) or [])


def internal_request_id(pending_request: Any) -> str:
    return str(pending_request.metadata.internal_request_id)


def router_config(router_cls: type, kwargs: dict[str, Any], stats_period_s: float) -> Any:
    """A ``RequestRouterConfig`` for our router class."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(
        request_router_class=router_cls,
        request_router_kwargs=kwargs,
        request_routing_stats_period_s=stats_period_s,
        request_routing_stats_timeout_s=max(stats_period_s * 10, 5.0),
    )


def current_replica_key() -> str:
    from ray import serve

    return str(serve.get_replica_context().replica_id.unique_id)


def actor_died_errors() -> tuple[type[BaseException], ...]:
    """Errors a handle call raises when its replica died."""
    from ray import exceptions

    names = ("RayActorError", "ActorDiedError", "ActorUnavailableError")
    return tuple(getattr(exceptions, n) for n in names if hasattr(exceptions, n))
