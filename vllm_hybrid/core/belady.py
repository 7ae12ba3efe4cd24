"""The clairvoyant reference row: Belady's eviction (farthest next use first) over the index.

The simulator records every future use first (:class:`BeladyOracle`); :class:`BeladyPolicy`
then ranks by it and snapshots only where a later request resumes.
"""

from __future__ import annotations

import bisect
from collections.abc import Hashable
from typing import ClassVar

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import AdmitContext
from vllm_hybrid.core.policy_base import PolicyBase, all_positions


class BeladyOracle:
    """Future uses per key, from an unbounded replay: request indices, ascending."""

    def __init__(self) -> None:
        self.kv_uses: dict[Hashable, list[int]] = {}
        self.snap_uses: dict[Hashable, list[int]] = {}

    def record(self, request_index: int, path_keys: list[Hashable], target: Hashable) -> None:
        for key in path_keys:
            self.kv_uses.setdefault(key, []).append(request_index)
        if target is not None:
            self.snap_uses.setdefault(target, []).append(request_index)

    @staticmethod
    def next_use(uses: list[int] | None, now: int) -> float:
        if not uses:
            return float("inf")
        i = bisect.bisect_right(uses, now)
        return float(uses[i]) if i < len(uses) else float("inf")


class BeladyPolicy(PolicyBase):
    """Clairvoyant reference: snapshots only where a later request will resume, and evict what
    is used farthest in the future (never-used first). Not an exact optimum for prefix trees."""

    name: ClassVar[str] = "belady"

    def __init__(self, cost: CostModel, oracle: BeladyOracle) -> None:
        super().__init__(cost)
        self.oracle = oracle

    def kv_priority(self, node: Node, now: int) -> float | None:
        if not node.is_leaf:
            return None
        partial = node.n_tokens != self.block_tokens
        table = self.oracle.snap_uses if partial else self.oracle.kv_uses
        return -self.oracle.next_use(table.get(node.key), now)

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        if node.is_leaf:
            return None
        return -self.oracle.next_use(self.oracle.snap_uses.get(node.key), now)

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        now, uses = ctx.request_index, self.oracle.snap_uses
        return [
            p
            for p in all_positions(ctx)
            if self.oracle.next_use(uses.get(ctx.key_at(p)), now) != float("inf")
        ]
