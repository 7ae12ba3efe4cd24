"""What the policies share: the base class with the defaults, a node's segment, and positions.

``core/policies.py`` (the baselines and ``POLICIES``), ``core/flop.py`` (ours) and
``core/belady.py`` (the clairvoyant reference) build on it.
"""

from __future__ import annotations

from typing import ClassVar

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.host_tier import HostTier
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import AdmitContext


def leaf_segment(node: Node, host: HostTier | None = None) -> tuple[int, int]:
    """(end of the nearest snapshot above ``node``, KV bytes freed with ``node``'s leaf chain).

    The chain is ``node`` and the ancestors that would be left as dead leaves by its eviction:
    those with no snapshot, no lock and no other child. A snapshot on the host tier counts."""
    chain_bytes, chain_open = node.kv_bytes, True
    walk = node.parent
    while (
        walk is not None
        and walk.parent is not None
        and not walk.has_snapshot
        and not (host is not None and host.holds(walk))
    ):
        # walk.n_children == 1, inlined (hot: every flop/marconi priority)
        if (
            chain_open
            and not walk.refs
            and len(walk.children) + sum(map(len, walk.partials.values())) == 1
        ):
            chain_bytes += walk.kv_bytes
        else:
            chain_open = False
        walk = walk.parent
    return (walk.end_tokens if walk is not None else 0), chain_bytes


class PolicyBase:
    """Defaults: never evict, no snapshots. Subclasses override what they model."""

    name: ClassVar[str] = "base"

    def __init__(self, cost: CostModel) -> None:
        self.cost = cost
        self.block_tokens = cost.block_tokens
        self.host: HostTier | None = None

    def bind_host(self, host: HostTier) -> None:
        """Called by the index that owns a host tier (the policy may rank by it)."""
        self.host = host

    def has_state(self, node: Node) -> bool:
        """A resume point at ``node``: its snapshot on the device or on the host tier."""
        return node.has_snapshot or (self.host is not None and self.host.holds(node))

    def kv_priority(self, node: Node, now: int) -> float | None:
        return None

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        return None

    def on_evict(self, priority: float) -> None:
        return None

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        return []

    def observe(self, ctx: AdmitContext, hit_node: Node) -> None:
        """Learn from a request's lookup (policy state only; the index is not touched)."""
        return None


def all_positions(ctx: AdmitContext) -> list[int]:
    """Every block boundary of the cacheable content and its exact end."""
    b = ctx.block_tokens
    out = list(range(b, ctx.last_boundary_tokens + 1, b))
    if ctx.cacheable_tokens % b:
        out.append(ctx.cacheable_tokens)
    return out
