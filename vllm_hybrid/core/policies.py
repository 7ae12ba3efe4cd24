"""Admission + eviction policies: one small object each, pure functions of a node and the time.

Baselines model real systems (see docs/policies.md for where each differs from the original):

* ``vllm``      vLLM 0.32 align mode, retention interval 0: a state at the prompt's last block
                boundary ``floor((len - 1) / B) * B`` and at block-floored shared-prefix junctions
                (when the KV hit is longer than the state hit); per-block LRU on one pool.
* ``lru-dense`` vLLM's dense mode: a state at every block boundary; per-block LRU.
* ``sglang``    SGLang's radix cache, ``extra_buffer``: a state per prefill chunk (its last
                64-token grid point, or the branching point), the last decode-track boundary
                at the end; none at split points (tombstones); LRU over KV leaves and states.
* ``marconi``   states at speculative branch points and exact ends of turns; evicts leaves and
                single-child nodes by ``recency / window + alpha * FLOP efficiency``.
* ``flop``      ours: GreedyDual-Size-Frequency on FLOPs saved per byte (no tuned knob).

With a host tier (``core/host_tier.py``), the baselines use it as a victim cache (what they evict
alone is demoted); ``flop`` also ranks by it: a state that can go to the host is worth, on the
device, only the transfer it saves, and a KV leaf whose state is on the host keeps its value.

Reference rows: ``infinite`` (dense states, never evicts) and ``belady`` (clairvoyant).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Hashable
from typing import ClassVar

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.ghosts import GhostBalance
from vllm_hybrid.core.host_tier import HostTier
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import AdmitContext, output_state_position
from vllm_hybrid.core.sglang import (
    CHUNKED_PREFILL_TOKENS,
    FLA_CHUNK_TOKENS,
    TRACK_INTERVAL_TOKENS,
    SglangGrid,
)

_NEVER = float("-inf")
_DEPTH_SLOTS = float(1 << 22)  # tie-break room below one time step for LRU keys
_HIT_CAP = 3  # hit counts >= this share one learned reuse rate
_DEPTH_CLASSES = 32  # log2 buckets of content depth for the learned reuse rate
#: Requests whose class ``flop`` remembers (for the nodes they inserted): the most recent ones,
#: so its memory is bounded (~6 MB) on an engine that serves requests for months; a node whose
#: inserter was forgotten ranks as a class never seen (P = 1, as at the start).
_ORIGINS_KEPT = 1 << 16


def _segment(node: Node, host: HostTier | None = None) -> tuple[int, int]:
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


class _Base:
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


class InfinitePolicy(_Base):
    """Reference: a snapshot at every block boundary and exact end; with an unbounded budget."""

    name: ClassVar[str] = "infinite"

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        return all_positions(ctx)


class VllmPolicy(_Base):
    """vLLM 0.32 align mode (``prefix_cache_retention_interval=0``), per-block LRU."""

    name: ClassVar[str] = "vllm"

    def kv_priority(self, node: Node, now: int) -> float | None:
        # One free queue: least recently freed first; a request frees its tail first.
        return node.last_access * _DEPTH_SLOTS - node.end_tokens / self.block_tokens

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        return node.snap_access * _DEPTH_SLOTS - node.end_tokens / self.block_tokens

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        return align_mode_positions(ctx)


def align_mode_positions(ctx: AdmitContext) -> list[int]:
    """Where vLLM 0.32's align mode keeps states (``MambaManager``, retention interval 0): the
    prompt's last block boundary ``floor((len - 1) / B) * B`` (the replay boundary) and the
    block-floored junction of a shared prefix once its KV is cached past the state hit."""
    b = ctx.block_tokens
    out = []
    replay = (ctx.prompt_tokens - 1) // b * b
    if replay > 0:
        out.append(replay)
    if ctx.kv_tokens > ctx.hit_tokens:  # junction, seen for the second time
        out.append(ctx.kv_tokens)
    return out


class EngineAdmission:
    """Where the engine takes state snapshots today, whatever policy ranks its cache: vLLM's
    align mode (:func:`align_mode_positions`; ``snapshot_every`` at its default ``engine``)
    and, past the prompt, the block boundaries of the answer that ``policy`` keeps for a next
    turn (:func:`~vllm_hybrid.core.policy.output_state_position`, as the adapter's
    ``OutputStates`` asks it). ``ctx.cacheable_tokens`` is what the request computed (prompt
    plus answer but its last token). The simulator replays an engine row with it
    (``bench/predict.py``)."""

    def __init__(self, policy: object, unit_tokens: int) -> None:
        self.policy = policy
        self.unit_tokens = unit_tokens

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        out = align_mode_positions(ctx)
        b, prompt = ctx.block_tokens, ctx.prompt_tokens
        for end in range((prompt // b + 1) * b, ctx.cacheable_tokens + 1, b):
            kept = output_state_position(
                self.policy, prompt, end, b, self.unit_tokens, hit_tokens=ctx.hit_tokens
            )
            if kept == end:
                out.append(end)
        return out


class LruDensePolicy(VllmPolicy):
    """vLLM's dense mode (no retention interval): a state at every block boundary, LRU."""

    name: ClassVar[str] = "lru-dense"

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        b = ctx.block_tokens
        return list(range(b, ctx.last_boundary_tokens + 1, b))


class SglangPolicy(_Base):
    """SGLang 0.5.23's hybrid radix cache (``UnifiedRadixCache`` + ``MambaComponent``; 0.5.9's
    ``MambaRadixCache``), ``extra_buffer`` strategy, with the block as its page.

    Admission (:class:`~vllm_hybrid.core.sglang.SglangGrid`): one state per prefill chunk (its
    last grid point, or the branching point of a KV match that ends past the state hit) and,
    at the end, the last decode-track boundary; the KV past the last state is not kept
    (:meth:`kv_end_tokens`). Split points keep no state (tombstones: KV only).
    Eviction: LRU over KV leaves (a leaf goes with its state) and LRU over interior states
    (``MambaComponent.refresh_lru``: a state is refreshed when it is hit or inserted), the two
    orders merged by time in one budget; ``replay(..., state_budget_bytes=...)`` gives the
    states a pool of their own (:func:`~vllm_hybrid.core.sglang.pool_split_bytes`).
    Left out: ``no_buffer`` (page 1, exact-position states), the KV and state a decode leaves
    past the prompt where the trace does not know the output (Mooncake), running requests'
    own state slots, HiCache, ``mamba_max_states_per_path`` (default off).
    """

    name: ClassVar[str] = "sglang"

    def __init__(
        self,
        cost: CostModel,
        chunk_tokens: int = CHUNKED_PREFILL_TOKENS,
        model_chunk_tokens: int = FLA_CHUNK_TOKENS,
        track_interval_tokens: int = TRACK_INTERVAL_TOKENS,
    ) -> None:
        super().__init__(cost)
        self.grid = SglangGrid.of(
            self.block_tokens, model_chunk_tokens, track_interval_tokens, chunk_tokens
        )

    def kv_priority(self, node: Node, now: int) -> float | None:
        return float(node.last_access) if node.is_leaf else None

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        return None if node.is_leaf else float(node.snap_access)

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        grid, prompt = self.grid, ctx.prompt_tokens
        out = grid.prefill_positions(prompt, ctx.hit_tokens, ctx.kv_tokens)
        if ctx.cacheable_tokens > prompt:  # the output is known: the decode's last track
            last = grid.finish_position(prompt, ctx.cacheable_tokens - 1)
            if last:
                out.append(last)
        return out

    def kv_end_tokens(self, ctx: AdmitContext, positions: list[int]) -> int:
        """The tree keeps a request's KV up to its last state only (``checkpoint_into_tree``
        cuts the insert at the state's length; the rest is freed)."""
        return max(positions, default=0)

    def output_state_positions(self, ctx: AdmitContext) -> list[int]:
        """For an engine that can keep only the state at the end of the output
        (:func:`~vllm_hybrid.core.policy.output_state_position`): that end where SGLang keeps
        a state in the output at all, i.e. its decode crossed a track boundary."""
        end = ctx.cacheable_tokens
        return [end] if self.grid.finish_position(ctx.prompt_tokens, end) else []


class MarconiPolicy(_Base):
    """Marconi: branch-point + end-of-turn states; utility = recency + alpha * FLOPs/byte."""

    name: ClassVar[str] = "marconi"

    def __init__(self, cost: CostModel, alpha: float = 1.0, window: int = 500) -> None:
        super().__init__(cost)
        self.alpha = alpha
        self.window = window
        ref_tokens = 4096  # efficiency of a 4k-token segment with its state: the unit scale
        ref_bytes = ref_tokens * cost.kv_bytes_per_token + cost.snapshot_bytes
        self.eff_ref = cost.span_flops(0, ref_tokens) / max(ref_bytes, 1)

    def _utility(self, node: Node, saved_flops: float, freed_bytes: int) -> float:
        efficiency = saved_flops / max(freed_bytes, 1) / self.eff_ref
        return node.last_access / self.window + self.alpha * efficiency

    def kv_priority(self, node: Node, now: int) -> float | None:
        if not node.is_leaf:
            return None
        if not node.has_snapshot:
            return _NEVER  # dead tail of an evicted radix node: goes with it
        prev_end, chain_bytes = _segment(node)
        saved = self.cost.span_flops(prev_end, node.end_tokens)
        return self._utility(node, saved, chain_bytes + self.cost.snapshot_bytes)

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        if node.n_children != 1:
            return None  # leaves go with their KV; branch points are kept
        prev_end, _ = _segment(node)
        saved = self.cost.span_flops(prev_end, node.end_tokens)
        return self._utility(node, saved, self.cost.snapshot_bytes)  # only the state is freed

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        out = [ctx.cacheable_tokens]
        if ctx.kv_tokens > ctx.hit_tokens and ctx.kv_tip_branches:
            out.append(ctx.kv_tokens)  # speculative insertion found a branch point
        return out


class FlopPolicy(_Base):
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
        prev_end, chain_bytes = _segment(node, self.host)
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


class BeladyPolicy(_Base):
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


#: Online policies selectable by name (the reference rows are built by the simulator).
POLICIES: dict[str, type[_Base]] = {
    p.name: p for p in (VllmPolicy, LruDensePolicy, SglangPolicy, MarconiPolicy, FlopPolicy)
}
