"""``flop``, ours: GreedyDual-Size-Frequency on FLOPs saved per byte held, balanced ARC-style.

See docs/policies.md for the formula and how each term is learned.
"""

from __future__ import annotations

import math
from typing import ClassVar

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.ghosts import GhostBalance
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import AdmitContext
from vllm_hybrid.core.policy_base import PolicyBase, leaf_segment

_HIT_CAP = 3  # hit counts >= this share one learned reuse rate
_DEPTH_CLASSES = 32  # log2 buckets of content depth for the learned reuse rate
#: Requests whose class ``flop`` remembers (for the nodes they inserted): the most recent ones,
#: so its memory is bounded (~6 MB) on an engine that serves requests for months; a node whose
#: inserter was forgotten ranks as a class never seen (P = 1, as at the start).
_ORIGINS_KEPT = 1 << 16


class FlopPolicy(PolicyBase):
    """Ours: GreedyDual-Size-Frequency on FLOPs saved per byte held, balanced ARC-style.

    ``priority = clock + (hits + 1) * P(another hit) * (eff / eff_ref) ** gamma`` with
    ``eff = saved_flops / bytes``; P is learned online (per hit count, apart for branch points),
    ``gamma`` in [0, 1] by ghost hits (:mod:`vllm_hybrid.core.ghosts`: 0 ranks by recency, 1 by
    value). ``clock`` is the priority of the last evicted entry, so entries not used for a while
    fall below newly used ones (aging). ``saved_flops`` is the prefill a hit here saves over the
    next snapshot above.
    """

    name: ClassVar[str] = "flop"

    def __init__(self, cost: CostModel, overhead: float = 0.25) -> None:
        super().__init__(cost)
        self.clock = 0.0
        # Sparse checkpoints: one state per interval whose KV is 1/overhead times the state, so
        # the states of a path cost at most ``overhead`` of its KV; a divergence then loses at
        # most one interval of recompute.
        snap_tokens = cost.snapshot_bytes / max(cost.kv_bytes_per_token, 1)
        blocks = max(1, round(snap_tokens / overhead / self.block_tokens))
        self.interval_tokens = blocks * self.block_tokens
        # Reuse learned online per request class (did it resume from a hit; log2 of the depth
        # of its content): how often content a request of that class inserted was later
        # resumed from (Laplace-smoothed). Deep chat histories belong to sessions near their end.
        self._class_of: dict[int, int] = {}
        self._inserted = [0] * 2 * _DEPTH_CLASSES
        self._reused = [0] * 2 * _DEPTH_CLASSES
        self._reused_origins: set[int] = set()
        self.origins_kept = _ORIGINS_KEPT
        # reached[branch][k]: snapshots that got a k-th hit (the last slot counts every hit
        # past the cap), so P(another hit | k hits) is learned online: chat histories are
        # resumed once and die, shared prefixes are resumed again and again. Branch points
        # (two or more continuations) are counted apart, so the many turn ends of chat and
        # agent sessions do not condemn a shared system prompt's state after its first hit.
        self._reached = [[0] * (_HIT_CAP + 2), [0] * (_HIT_CAP + 2)]
        # The unit of value: a hit that saves one interval from the start, per byte it holds.
        ref_bytes = self.interval_tokens * cost.kv_bytes_per_token + cost.snapshot_bytes
        ref = cost.span_flops(0, self.interval_tokens) / max(ref_bytes, 1)
        self.balance = GhostBalance(self.block_tokens, ref)
        self._now = 0
        # Constants of the hot priority path (the cost model is frozen, the shape immutable).
        self._snap_bytes = cost.snapshot_bytes
        self._linear = cost.shape.linear_flops_per_token
        self._pair = cost.shape.pair_flops

    def observe(self, ctx: AdmitContext, hit_node: Node) -> None:
        self._now = max(self._now, ctx.request_index)
        self.balance.observe(ctx)
        if ctx.hit_tokens:
            reached = self._reached[hit_node.n_children >= 2]
            reached[min(hit_node.snap_hits, _HIT_CAP + 1)] += 1
        origin = hit_node.origin
        if ctx.hit_tokens and origin in self._class_of and origin not in self._reused_origins:
            self._reused_origins.add(origin)
            self._reused[self._class_of[origin]] += 1
        if ctx.cacheable_tokens > ctx.kv_tokens:
            depth = min(max(ctx.cacheable_tokens, 1).bit_length() - 1, _DEPTH_CLASSES - 1)
            cls = 2 * depth + int(ctx.hit_tokens > 0)
            self._class_of[ctx.request_index] = cls
            self._inserted[cls] += 1
            if len(self._class_of) > self.origins_kept:  # indices grow: the first is the oldest
                oldest = next(iter(self._class_of))
                del self._class_of[oldest]
                self._reused_origins.discard(oldest)

    def reuse_probability(self, node: Node) -> float:
        """Learned P(another hit): by hit count once resumed from, else by inserter class."""
        k = node.snap_hits
        kids = len(node.children) + (sum(map(len, node.partials.values())) if node.partials else 0)
        reached = self._reached[kids >= 2]
        if k >= _HIT_CAP:
            return (reached[_HIT_CAP + 1] + 1) / (sum(reached[_HIT_CAP:]) + 2)
        if k:
            return (reached[k + 1] + 1) / (reached[k] + 2)
        if node.origin not in self._class_of:
            return 1.0
        cls = self._class_of[node.origin]
        return (self._reused[cls] + 1) / (self._inserted[cls] + 2)

    def _weight(self, node: Node) -> float:
        """Frequency discounted by liveness: (hits + 1) * P(another hit)."""
        return (node.snap_hits + 1) * self.reuse_probability(node)

    def on_evict(self, priority: float) -> None:
        self.clock = max(self.clock, priority)

    def kv_priority(self, node: Node, now: int) -> float | None:
        if node.children or node.partials:
            return None  # not a leaf
        if not node.has_snapshot and not (self.host is not None and self.host.holds(node)):
            return self.clock  # dead KV (no state, has_state inlined): saves nothing
        if now > self._now:
            self._now = now
        return self._value(node, self._efficiency(node, False))

    def _value(self, node: Node, eff: float) -> float:
        """``clock + _weight(node) * balance.scale(eff)``, the same arithmetic inlined (hot:
        one call per ranked entry of the engine's mirror)."""
        weight = (node.snap_hits + 1) * self.reuse_probability(node)
        if eff <= 0.0:
            return self.clock + weight * 0.0
        balance = self.balance
        return self.clock + weight * math.exp(balance.gamma * (math.log(eff) - balance.log_eff_ref))

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        if now > self._now:
            self._now = now
        if self.host is not None and self.host.budget_bytes >= self.cost.snapshot_bytes:
            # It would be demoted, not lost: on the device it only saves the transfer back.
            eff = self.host.device_flops_per_byte
            return self.clock + self._weight(node) * self.balance.scale(eff)
        if not node.refs and not node.children and not node.partials:
            return None  # a free leaf goes with its KV (kv_priority)
        # An interior state, or a leaf's whose KV is in use (an engine's running request holds
        # the KV it resumed from; the state it resumed from was copied and is free).
        return self._value(node, self._efficiency(node, True))

    def _efficiency(self, node: Node, snapshot_only: bool) -> float:
        """FLOPs a hit here saves over the snapshot above, per byte its eviction frees (a
        state on the host tier frees no device bytes)."""
        prev_end, chain_bytes = leaf_segment(node, self.host)
        end = node.end_tokens
        if not 0 <= prev_end <= end:
            raise ValueError(f"bad span [{prev_end}, {end})")
        # self.cost.span_flops(prev_end, end), inlined (hot), same integer arithmetic
        pairs = (end * (end + 1) - prev_end * (prev_end + 1)) // 2
        saved = float(self._linear * (end - prev_end) + self._pair * pairs)
        freed = (self._snap_bytes if node.has_snapshot else 0) + (
            0 if snapshot_only else chain_bytes
        )
        return saved / max(freed, 1)

    def on_evicted(self, node: Node, snapshot_only: bool, live_entries: int) -> None:
        """Index hook (before the entry goes): remember it as a ghost of what evicted it."""
        if not node.has_snapshot:
            return  # dead KV: nothing a later request could have resumed from
        eff = self._efficiency(node, snapshot_only)
        age = self._now - max(node.last_access, node.snap_access)
        self.balance.on_evicted(node.key, node.end_tokens, eff, age, live_entries)

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        out = ctx.end_positions()
        if ctx.kv_tokens > ctx.hit_tokens:
            out.append(ctx.kv_tokens)
        out.extend(self.checkpoint_positions(ctx))
        return out

    def checkpoint_positions(self, ctx: AdmitContext) -> list[int]:
        """Periodic states in the new content, one interval apart. Where the exact end is a
        resume point (the next turn extends it), they are placed backwards from it, so no
        checkpoint sits just above the end state it would duplicate; else at multiples of I."""
        step, b = self.interval_tokens, ctx.block_tokens
        if ctx.exact_end:
            last = (ctx.cacheable_tokens - step) // b * b
            return list(range(last, ctx.kv_tokens, -step)) if last > ctx.kv_tokens else []
        first = (ctx.kv_tokens // step + 1) * step
        return list(range(first, ctx.cacheable_tokens + 1, step))
