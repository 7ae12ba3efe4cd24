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
* ``learned``   ``flop`` with P(another hit) from an online logistic regression trained on
                hits and ghosts of evicted states (``core/learned.py``); an option.

With a host tier (``core/host_tier.py``), the baselines use it as a victim cache (what they evict
alone is demoted); ``flop`` also ranks by it: a state that can go to the host is worth, on the
device, only the transfer it saves, and a KV leaf whose state is on the host keeps its value.

Reference rows: ``infinite`` (dense states, never evicts) and ``belady`` (clairvoyant).

Here: the baselines, the engine's admission (:class:`EngineAdmission`) and :data:`POLICIES`;
the shared base in ``core/policy_base.py``, ``flop`` in ``core/flop.py``, ``belady`` in
``core/belady.py`` (both importable from here too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

from vllm_hybrid.core.belady import BeladyOracle, BeladyPolicy
from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.flop import FlopPolicy
from vllm_hybrid.core.learned import LearnedPolicy
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import (
    AdmitContext,
    output_state_position,
    prompt_end_stop,
    prompt_floor_stop,
)
from vllm_hybrid.core.policy_base import PolicyBase, all_positions, leaf_segment
from vllm_hybrid.core.sglang import (
    CHUNKED_PREFILL_TOKENS,
    FLA_CHUNK_TOKENS,
    TRACK_INTERVAL_TOKENS,
    SglangGrid,
)

_NEVER = float("-inf")
_DEPTH_SLOTS = float(1 << 22)  # tie-break room below one time step for LRU keys


class InfinitePolicy(PolicyBase):
    """Reference: a snapshot at every block boundary and exact end; with an unbounded budget."""

    name: ClassVar[str] = "infinite"

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        return all_positions(ctx)


class VllmPolicy(PolicyBase):
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

    def __init__(
        self,
        policy: object,
        unit_tokens: int,
        optional_fit: Callable[[int], bool] | None = None,
    ) -> None:
        self.policy = policy
        self.unit_tokens = unit_tokens
        #: at a unit below the block: whether a prompt of n tokens gets the optional stops
        #: (``core.policy.optional_snapshots_fit`` on the engine's pool)
        self.optional_fit = optional_fit

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        out = align_mode_positions(ctx)
        b, prompt = ctx.block_tokens, ctx.prompt_tokens
        u = self.unit_tokens
        if u < b:
            fits = self.optional_fit is not None and self.optional_fit(prompt)
            out = [p for p in out if p != (prompt - 1) // b * b] + _unit_prompt_stops(ctx, u, fits)
            if ctx.exact_end:
                kept = output_state_position(
                    self.policy, prompt, ctx.cacheable_tokens, b, u, hit_tokens=ctx.hit_tokens
                )
                if kept:
                    out.append(kept)
            return sorted(set(out))
        out += [p for p in ctx.stops if p > ctx.hit_tokens]  # block-aligned at this unit
        for end in range((prompt // b + 1) * b, ctx.cacheable_tokens + 1, b):
            kept = output_state_position(
                self.policy, prompt, end, b, self.unit_tokens, hit_tokens=ctx.hit_tokens
            )
            if kept == end:
                out.append(end)
        return out


def _unit_prompt_stops(ctx: AdmitContext, unit: int, optional: bool) -> list[int]:
    """Where vLLM 0.32's align mode keeps a prompt's states at a match unit ``unit`` below the
    block, with a prefill checkpoint block (the CPU engine's): a hit inside a block resumes
    with a chunk to the next block boundary, whose state is kept; the prompt's last chunk
    exports the state at ``P - 1`` floored to the unit as a checkpoint
    (``MambaManager._needs_internal_checkpoint``, ``is_mamba_prefill_checkpoint_valid``) only
    where the chunk's initial state lies in a block before the checkpoint's (the block before
    the prompt's last one). With the optional stops (the pool is roomy enough), the engine also
    keeps the prompt's last block boundary (``prompt_floor_stop``) and, at a one-token unit,
    the state at the prompt's own end ``P`` (``prompt_end_stop``). Junctions (the KV match
    past the hit) and the scheduler's stops (``ctx.stops``, each like a sub-block hit) end a
    chunk too (``align_mode_positions``)."""
    b, prompt, hit = ctx.block_tokens, ctx.prompt_tokens, ctx.hit_tokens
    out = []
    start = hit
    if hit % b and -(-hit // b) * b < prompt:
        start = -(-hit // b) * b
        out.append(start)
    if ctx.kv_tokens > hit:
        start = max(start, ctx.kv_tokens)
    for stop in ctx.stops:  # a sibling's stop keeps its state; a chunk to the block ends next
        if stop > hit:
            out.append(stop)
            up = -(-stop // b) * b
            start = max(start, stop if up >= prompt else up)
            if stop % b and up < prompt:
                out.append(up)
    floor = prompt_floor_stop(prompt, hit, b, unit) if optional else 0
    if floor:
        out.append(floor)
        start = max(start, floor)
    end = prompt_end_stop(prompt, hit, b, unit) if optional else 0
    if end:
        out.append(end)  # the last chunk ends there anyway; the state is kept (a CoW copy)
    exact = (prompt - 1) // unit * unit
    checkpoint_col = -(-prompt // b) - 2
    if checkpoint_col > (start - 1) // b and start + unit <= exact and start < exact < prompt:
        out.append(exact)
    return out


class LruDensePolicy(VllmPolicy):
    """vLLM's dense mode (no retention interval): a state at every block boundary, LRU."""

    name: ClassVar[str] = "lru-dense"

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        b = ctx.block_tokens
        return list(range(b, ctx.last_boundary_tokens + 1, b))


class SglangPolicy(PolicyBase):
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


class MarconiPolicy(PolicyBase):
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
        prev_end, chain_bytes = leaf_segment(node)
        saved = self.cost.span_flops(prev_end, node.end_tokens)
        return self._utility(node, saved, chain_bytes + self.cost.snapshot_bytes)

    def snapshot_priority(self, node: Node, now: int) -> float | None:
        if node.n_children != 1:
            return None  # leaves go with their KV; branch points are kept
        prev_end, _ = leaf_segment(node)
        saved = self.cost.span_flops(prev_end, node.end_tokens)
        return self._utility(node, saved, self.cost.snapshot_bytes)  # only the state is freed

    def snapshot_positions(self, ctx: AdmitContext) -> list[int]:
        out = [ctx.cacheable_tokens]
        if ctx.kv_tokens > ctx.hit_tokens and ctx.kv_tip_branches:
            out.append(ctx.kv_tokens)  # speculative insertion found a branch point
        return out


#: Online policies selectable by name (the reference rows are built by the simulator).
POLICIES: dict[str, type[PolicyBase]] = {
    p.name: p
    for p in (VllmPolicy, LruDensePolicy, SglangPolicy, MarconiPolicy, FlopPolicy, LearnedPolicy)
}

__all__ = [
    "POLICIES",
    "BeladyOracle",
    "BeladyPolicy",
    "EngineAdmission",
    "FlopPolicy",
    "InfinitePolicy",
    "LearnedPolicy",
    "LruDensePolicy",
    "MarconiPolicy",
    "SglangPolicy",
    "VllmPolicy",
    "align_mode_positions",
    "all_positions",
]
