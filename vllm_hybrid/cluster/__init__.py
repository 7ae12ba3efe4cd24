"""vllm-hybrid on Ray Serve: N vLLM replicas behind one OpenAI-compatible ingress, routed by the
core's state-aware decision (docs/cluster.md). ``routing.py`` is stdlib + core; Ray is imported
only inside functions, through ``ray_api.py`` (the one place that names Ray's alpha
request-router API), by ``serve_router.py`` (loaded by Ray itself) and ``app.py``'s builder, so
the package imports without the cluster extra; vLLM only through
``adapters/vllm/compat/cluster.py``."""

from vllm_hybrid.cluster.routing import ClusterRouter, Digest, RouteRecord, RouteRequest

__all__ = ["ClusterRouter", "Digest", "RouteRecord", "RouteRequest"]
