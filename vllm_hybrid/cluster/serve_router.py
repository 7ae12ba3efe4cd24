"""Our Ray Serve ``RequestRouter``: Ray's replica bookkeeping around :class:`ClusterRouter`.

Ray builds it in every process that holds a handle to the engine deployment (the ingress) and
calls ``choose_replicas`` once per routing attempt; we return the chosen replica as the first
rank and the others as a second (Ray sends to the first rank that accepts, so a full replica
spills to the others). Replica digests arrive in ``RunningReplica.routing_stats`` (the engine
replicas' ``record_routing_stats``, every ``request_routing_stats_period_s``). The router does
not subclass ``FIFOMixin``: Ray then hands each replica to the very request it was chosen for.

Ray pickles this module **by value** (``RequestRouterConfig._serialize_request_router_cls``
registers it with ``cloudpickle.register_pickle_by_value``), so a module global here would be a
copy in the ingress; the routers built in a process are registered in ``routing.py`` instead
(imported by reference), where the ingress finds its own.
"""

from __future__ import annotations

import logging
import random
from typing import Any

from vllm_hybrid.cluster import ray_api, routing
from vllm_hybrid.cluster.routing import ClusterRouter, RouteRequest

RequestRouter = ray_api.request_router_class()
LOG = logging.getLogger("vllm_hybrid.router")


def build_cluster_router(
    policy: str,
    shape_path: str,
    throughput_tflops: float,
    overload_wait_s: float,
    seed: int = 0,
) -> ClusterRouter:
    from vllm_hybrid.adapters.vllm.compat.cluster import local_none_hash, prompt_hashes
    from vllm_hybrid.core import CostModel, load_shape

    cost = CostModel(load_shape(shape_path), 16)
    return ClusterRouter(
        policy=policy,
        cost=cost,
        throughput_flops=throughput_tflops * 1e12,
        hasher=lambda ids, salt, hbs, algo: prompt_hashes(list(ids), salt, hbs, algo),
        local_none_hash=local_none_hash,
        overload_wait_s=overload_wait_s,
        seed=seed,
    )


class HybridRequestRouter(RequestRouter):  # type: ignore[misc, valid-type]
    """Routes by the core's decision (``policy="state"``) or a baseline (module docstring)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self.hybrid = build_cluster_router(**kwargs)
        self._ids: dict[str, str] = {}  # Ray's internal request id -> ours
        routing.register_router(self.app_name, self.hybrid)

    def _live(self) -> list[str]:
        return [ray_api.replica_key(r) for r in self.curr_replicas.values()]

    def _absorb(self, key: str, replica: Any) -> None:
        stats = ray_api.replica_routing_stats(replica)
        self.hybrid.update_digest(key, stats.get("digest"))
        if stats.get("metrics"):
            self.hybrid.last_stats[key] = stats["metrics"]

    def update_replicas(self, replicas: list[Any]) -> None:
        super().update_replicas(replicas)
        for replica in replicas:
            self._absorb(ray_api.replica_key(replica), replica)
        gone = self.hybrid.sync_replicas([ray_api.replica_key(r) for r in replicas])
        if gone:
            LOG.warning("replicas left, their entries dropped: %s", ", ".join(gone))

    def on_replica_actor_died(self, replica_id: Any) -> None:
        super().on_replica_actor_died(replica_id)
        dead = ray_api.replica_key(replica_id)
        self.hybrid.sync_replicas([r for r in self._live() if r != dead])
        LOG.warning("replica %s died: its digest and entries are dropped", dead)

    async def choose_replicas(
        self, candidate_replicas: list[Any], pending_request: Any = None
    ) -> list[list[Any]]:
        if not candidate_replicas:
            return []
        by_key = {ray_api.replica_key(r): r for r in candidate_replicas}
        for key, replica in by_key.items():
            self._absorb(key, replica)
        args = ray_api.pending_args(pending_request) if pending_request is not None else []
        route = args[0] if args and isinstance(args[0], RouteRequest) else None
        if route is None:  # not a routed call (health, models): any replica
            return [random.sample(candidate_replicas, len(candidate_replicas))]
        internal = ray_api.internal_request_id(pending_request)
        if self._ids.get(internal) == route.request_id:
            # Ray routes the same request again (the replica it chose refused it): the credit
            # of the earlier choice is void
            self.hybrid.retract(route.request_id)
        self._ids[internal] = route.request_id
        record = self.hybrid.choose(route, sorted(by_key))
        chosen = by_key[record.replica]
        return [[chosen], [r for r in candidate_replicas if r is not chosen]]

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        ours = self._ids.pop(str(internal_request_id), None)
        if ours is not None:
            self.hybrid.completed(ours)
