"""The routers the cluster simulation compares: ours (``state``) and the baselines.

Each router gets, per request, the request's block keys, its session (None if unknown) and
one :class:`~vllm_hybrid.core.ReplicaView` per replica (with ``hit_tokens`` and ``kv_tokens``
from the replica's index only when the router reads indexes: ``needs_index``), and returns a
replica id; ``routed`` tells it where the request went (the text trees insert then).

* ``round-robin``: replica ``i mod N`` for the ``i``-th request.
* ``least-loaded``: the power of two choices on ongoing requests (Ray Serve's default
  ``PowerOfTwoChoicesRequestRouter``: two replicas at random, the shorter queue).
* ``text-prefix``: Ray Serve's ``PrefixCacheAffinityRouter`` (Ray 2.60.0:
  ``ray/llm/_internal/serve/routing_policies/prefix_aware/prefix_aware_router.py``, defaults
  of its ``initialize_state`` as shipped: ``imbalanced_threshold=inf`` on queue lengths (it was
  10 until ray-project/ray#59390, Jan 2026: "users expect the router to be purely prefix
  cache-based by default"), ``match_rate_threshold=0.1``, no tree eviction). If the longest
  and shortest queue differ by more than the threshold (never, as shipped): power of two. Else
  the prompt is matched in a prefix tree of the prompts routed so far, one tree shared by all
  replicas, each node owned by the replicas whose prompts went through it; match rate =
  matched / prompt length. Below 0.1 the candidates are the replicas with the smallest trees,
  else the owners of the deepest matched node; the shortest queue among them wins. Ray's
  tree holds characters of the prompt text; ours holds the prompt's block keys (a node per
  ``block_tokens`` tokens), so a match is counted in whole blocks: an approximation of the
  character match, slightly shorter (the last partial block never matches).
* ``text-prefix-sglang``: sglang-router's ``cache_aware`` policy, the same idea with the
  defaults its launcher ships (``sglang_router/router_args.py::RouterArgs``:
  ``cache_threshold=0.3``, ``balance_abs_threshold=64``, ``balance_rel_threshold=1.5``; this
  model used the Rust ``CacheAwareConfig::default``'s 0.5 / 32 / 1.1 until 2026-12-04):
  imbalanced when max - min load > 64 *and* max > 1.5 * min, then the least loaded; else
  match rate > 0.3 goes to the replica that last inserted the deepest matched node,
  otherwise to the smallest tree. Its
  tree eviction (every 30 s down to ``max_tree_size`` per worker) is not modelled, which can
  only help its affinity.
* ``kv-prefix``: llm-d / NVIDIA Dynamo's KV router: the replicas' cached KV known exactly (KV
  events), states ignored. Dynamo's cost ``kv_overlap_score_weight * blocks to prefill after
  the longest cached KV prefix + active blocks`` with the shipped weight 1.0 and temperature
  0 (the lowest cost wins).
* ``state``: ours, :class:`~vllm_hybrid.core.StateRouter` (docs/cluster.md).
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Sequence

from vllm_hybrid.core import CostModel, ReplicaView, StateRouter, power_of_two

ROUTERS = (
    "round-robin",
    "least-loaded",
    "text-prefix",
    "text-prefix-sglang",
    "kv-prefix",
    "state",
)


class UnknownRouterError(ValueError):
    """A router name that is not one of :data:`ROUTERS`."""


def check_routers(names: Sequence[str]) -> list[str]:
    bad = [n for n in names if n not in ROUTERS]
    if bad or not names:
        what = ", ".join(map(repr, bad)) if bad else "(none given)"
        raise UnknownRouterError(f"unknown router {what}; known: {', '.join(ROUTERS)}")
    return list(names)


class Router:
    """The interface (and the round-robin router)."""

    name = "round-robin"
    needs_index = False

    def __init__(self, n_replicas: int, seed: int = 0) -> None:
        self.n = n_replicas
        self.rng = random.Random(seed)
        self._next = 0

    def route(
        self,
        keys: Sequence[Hashable],
        prompt_tokens: int,
        session: Hashable | None,
        views: Sequence[ReplicaView],
    ) -> int:
        pick = self._next % self.n
        self._next += 1
        return pick

    def routed(self, keys: Sequence[Hashable], prompt_tokens: int, replica: int) -> None:
        """Where the request went (``keys``: its prompt's full blocks)."""


class LeastLoadedRouter(Router):
    name = "least-loaded"

    def route(self, keys, prompt_tokens, session, views):  # type: ignore[no-untyped-def]
        return power_of_two(views, self.rng)


class TokenPrefixTree:
    """A multi-tenant prefix tree over block keys (chained, so a key names its whole prefix):
    which replicas routed a prompt through each node, who did last, and each replica's size
    in nodes. No eviction (Ray's default)."""

    def __init__(self, n_tenants: int) -> None:
        self.owners: dict[Hashable, set[int]] = {}
        self.last: dict[Hashable, int] = {}
        self.size = [0] * n_tenants

    def match(self, keys: Sequence[Hashable]) -> tuple[int, set[int], int | None]:
        """(matched blocks, owners of the deepest matched node, its last inserter)."""
        depth, owners, last = 0, set(), None
        for key in keys:
            found = self.owners.get(key)
            if not found:
                break
            depth, owners, last = depth + 1, found, self.last[key]
        return depth, owners, last

    def insert(self, keys: Sequence[Hashable], tenant: int) -> None:
        for key in keys:
            owners = self.owners.setdefault(key, set())
            if tenant not in owners:
                owners.add(tenant)
                self.size[tenant] += 1
            self.last[key] = tenant

    def smallest(self) -> list[int]:
        low = min(self.size)
        return [t for t, s in enumerate(self.size) if s == low]


class TextPrefixRouter(Router):
    """Ray Serve's ``PrefixCacheAffinityRouter`` (module docstring)."""

    name = "text-prefix"
    imbalanced_threshold = float("inf")
    match_rate_threshold = 0.1

    def __init__(self, n_replicas: int, block_tokens: int, seed: int = 0) -> None:
        super().__init__(n_replicas, seed)
        self.block_tokens = block_tokens
        self.tree = TokenPrefixTree(n_replicas)

    def _queue(self, views: Sequence[ReplicaView], r: int) -> int:
        return views[r].load.ongoing

    def _imbalanced(self, views: Sequence[ReplicaView]) -> bool:
        queues = [v.load.ongoing for v in views]
        return max(queues) - min(queues) > self.imbalanced_threshold

    def route(self, keys, prompt_tokens, session, views):  # type: ignore[no-untyped-def]
        if self._imbalanced(views):
            return power_of_two(views, self.rng)
        depth, owners, last = self.tree.match(keys)
        rate = depth * self.block_tokens / prompt_tokens
        candidates = self._candidates(rate, owners, last)
        return min(candidates, key=lambda r: (self._queue(views, r), r))

    def _candidates(self, rate: float, owners: set[int], last: int | None) -> list[int]:
        if rate < self.match_rate_threshold or not owners:
            return self.tree.smallest()
        return sorted(owners)

    def routed(self, keys, prompt_tokens, replica):  # type: ignore[no-untyped-def]
        self.tree.insert(keys, replica)


class SglangCacheAwareRouter(TextPrefixRouter):
    """sglang-router's ``cache_aware`` (module docstring)."""

    name = "text-prefix-sglang"
    cache_threshold = 0.3
    balance_abs_threshold = 64
    balance_rel_threshold = 1.5

    def _imbalanced(self, views: Sequence[ReplicaView]) -> bool:
        loads = [v.load.ongoing for v in views]
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold

    def route(self, keys, prompt_tokens, session, views):  # type: ignore[no-untyped-def]
        if self._imbalanced(views):
            return min(range(len(views)), key=lambda r: (views[r].load.ongoing, r))
        depth, owners, last = self.tree.match(keys)
        rate = depth * self.block_tokens / prompt_tokens
        if rate > self.cache_threshold and last is not None:
            return last
        return self.tree.smallest()[0]


class KvPrefixRouter(Router):
    """Dynamo's KV router cost, states ignored (module docstring)."""

    name = "kv-prefix"
    needs_index = True
    overlap_weight = 1.0

    def __init__(self, n_replicas: int, block_tokens: int, seed: int = 0) -> None:
        super().__init__(n_replicas, seed)
        self.block_tokens = block_tokens

    def route(self, keys, prompt_tokens, session, views):  # type: ignore[no-untyped-def]
        b = self.block_tokens

        def cost(v: ReplicaView) -> tuple[float, int]:
            prefill_blocks = -(-(prompt_tokens - v.kv_tokens) // b)
            active_blocks = -(-v.load.active_tokens // b)
            return self.overlap_weight * prefill_blocks + active_blocks, v.replica

        return min(views, key=cost).replica


class StateAwareRouter(Router):
    """Ours: the core's :class:`StateRouter`."""

    name = "state"
    needs_index = True

    def __init__(self, core: StateRouter, n_replicas: int, seed: int = 0) -> None:
        super().__init__(n_replicas, seed)
        self.core = core

    def route(self, keys, prompt_tokens, session, views):  # type: ignore[no-untyped-def]
        return self.core.choose(prompt_tokens, views, session).replica


def make_router(
    name: str,
    n_replicas: int,
    cost: CostModel,
    throughput_flops: float,
    *,
    seed: int = 0,
    overload_wait_s: float = 2.0,
) -> Router:
    check_routers([name])
    b = cost.block_tokens
    if name == "least-loaded":
        return LeastLoadedRouter(n_replicas, seed)
    if name == "text-prefix":
        return TextPrefixRouter(n_replicas, b, seed)
    if name == "text-prefix-sglang":
        return SglangCacheAwareRouter(n_replicas, b, seed)
    if name == "kv-prefix":
        return KvPrefixRouter(n_replicas, b, seed)
    if name == "state":
        core = StateRouter(cost, throughput_flops, overload_wait_s=overload_wait_s, seed=seed)
        return StateAwareRouter(core, n_replicas, seed)
    return Router(n_replicas, seed)
