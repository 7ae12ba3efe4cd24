"""What an engine tells the core about each request it starts, and the counters that follow.

The simulator (``sim/replay.py``) calls a policy's ``observe(ctx, hit_node)`` once per request
with what the lookup found; an engine adapter does the same through :class:`RequestFeed`, once
per request when it is first scheduled (not per lookup: a request that waits is looked up again,
and only the lookup it runs with counts). The feed also keeps the engine-side counters every
report uses (docs/policies.md "Definitions"): token hit rate, state hits, FLOPs saved.

Positions are in tokens. ``keys`` are the request's chained block keys at ``key_tokens``
granularity (vLLM: ``request.block_hashes`` at ``hash_block_size``), so the key of the prefix
ending at ``p`` is ``keys[p // key_tokens - 1]`` whenever ``p`` is a multiple of ``key_tokens``.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import AdmitContext

NodeOf = Callable[[Hashable], Node | None]


@dataclass
class FeedCounters:
    """Monotonic totals over the requests fed so far (Prometheus counters map 1:1)."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    state_hits: int = 0  # requests that resumed from a cached state
    state_misses: int = 0  # requests that found no state to resume from
    junction_tokens: int = 0  # cached KV past the state hit (reusable only with a new state)
    flops_total: float = 0.0  # prefill FLOPs of every prompt without caching
    flops_saved: float = 0.0  # prefill FLOPs the hits saved

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class RequestFeed:
    """Builds each started request's :class:`AdmitContext`, feeds ``policy.observe`` (when the
    policy learns online) and counts. Stateless apart from the counters and the clock."""

    def __init__(self, policy: object, cost: CostModel, key_tokens: int) -> None:
        if key_tokens <= 0 or cost.block_tokens % key_tokens:
            raise ValueError(f"key granularity {key_tokens} must divide {cost.block_tokens}")
        self.policy = policy
        self.cost = cost
        self.key_tokens = key_tokens
        self.counters = FeedCounters()
        self._observe = getattr(policy, "observe", None)

    def key_at(self, keys: Sequence[Hashable], tokens: int) -> Hashable:
        """Key of the prefix ending at ``tokens`` (None where the request has none)."""
        i = tokens // self.key_tokens - 1
        if tokens % self.key_tokens or not 0 <= i < len(keys):
            return None
        return keys[i]

    def started(
        self,
        request_index: int,
        prompt_tokens: int,
        hit_tokens: int,
        kv_tokens: int,
        keys: Sequence[Hashable],
        node_of: NodeOf,
    ) -> None:
        """A request starts: ``hit_tokens`` resumed from a state (0: none), the cached KV
        reaches ``kv_tokens >= hit_tokens``; ``node_of(key)`` is the cache's node for a key."""
        if not 0 <= hit_tokens <= min(kv_tokens, prompt_tokens):
            raise ValueError(f"hit {hit_tokens} must lie in [0, min({kv_tokens}, {prompt_tokens})]")
        c = self.counters
        c.requests += 1
        c.prompt_tokens += prompt_tokens
        c.hit_tokens += hit_tokens
        c.state_hits += hit_tokens > 0
        c.state_misses += hit_tokens == 0
        c.junction_tokens += kv_tokens - hit_tokens
        c.flops_total += self.cost.span_flops(0, prompt_tokens)
        c.flops_saved += self.cost.span_flops(0, hit_tokens)
        if self._observe is None:
            return
        hit_node = node_of(self.key_at(keys, hit_tokens)) if hit_tokens else None
        tip = node_of(self.key_at(keys, kv_tokens)) if kv_tokens else None
        ctx = AdmitContext(
            request_index=request_index,
            prompt_tokens=prompt_tokens,
            cacheable_tokens=prompt_tokens,  # an engine cannot know whether a turn follows
            hit_tokens=hit_tokens,
            kv_tokens=kv_tokens,
            kv_tip_branches=tip is not None and tip.n_children >= 2,
            block_tokens=self.cost.block_tokens,
            exact_end=True,
            key_at=lambda p: self.key_at(keys, p),
            probe=lambda i, n: self.key_at(keys, i * self.cost.block_tokens + n),
        )
        self._observe(ctx, hit_node if hit_node is not None else _NO_NODE)


#: Stands in for "no hit" (the simulator passes the index root there).
_NO_NODE = Node(None, None, 0, 0, 0)
