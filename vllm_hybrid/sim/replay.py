"""The replay loop: requests in arrival order against one index, one policy, one budget.

Each request: match its prompt (a hit must leave the last prompt token to compute, so at most
``prompt_tokens - 1``), lock the matched path, let the policy choose snapshot positions, insert
the blocks it leaves behind (prompt, plus output where a later turn extends it) with snapshots
where chosen, unlock. Requests are served one at a time (no overlap in time); the budget is
checked after every request and the index raises if any step would exceed it.

With a host tier (``host_bytes > 0``), snapshots the policy evicts alone are demoted to host
memory; a request whose hit ends on a host snapshot counts as a hit (its prefix is skipped, the
FLOPs are saved) and pays ``snapshot_bytes / host_bandwidth`` seconds of transfer
(``promote_seconds``), the price of the tier.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.host_tier import HostTier
from vllm_hybrid.core.index import PrefixIndex
from vllm_hybrid.core.node import LockHandle, Match
from vllm_hybrid.core.policies import BeladyOracle
from vllm_hybrid.core.policy import AdmitContext
from vllm_hybrid.sim.trace import KeyedRequest

ProgressFn = Callable[[int, int], None]


@dataclass
class RunStats:
    """Totals of one (policy, budget) run; rates are properties."""

    policy: str
    budget_bytes: int
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    flops_total: float = 0.0
    flops_saved: float = 0.0
    state_hits: int = 0
    snapshots_taken: int = 0
    snapshots_kept: int = 0
    evicted_kv_blocks: int = 0
    evicted_snapshots: int = 0
    peak_bytes: int = 0
    seconds: float = 0.0
    # host tier (all 0 without one)
    host_budget_bytes: int = 0
    host_hits: int = 0
    host_hit_tokens: int = 0
    host_flops_saved: float = 0.0
    demoted: int = 0
    host_dropped: int = 0
    host_invalidated: int = 0
    host_peak_bytes: int = 0
    promote_seconds: float = 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / max(self.prompt_tokens, 1)

    @property
    def flops_saved_rate(self) -> float:
        return self.flops_saved / max(self.flops_total, 1.0)

    @property
    def state_hit_rate(self) -> float:
        return self.state_hits / max(self.requests, 1)

    def to_dict(self) -> dict[str, float | int | str]:
        out: dict[str, float | int | str] = dict(asdict(self))
        out.update(
            token_hit_rate=self.token_hit_rate,
            flops_saved_rate=self.flops_saved_rate,
            state_hit_rate=self.state_hit_rate,
        )
        return out


class BudgetViolation(RuntimeError):
    """The loop saw more bytes held than the budget (a policy or index bug)."""


def _commit(
    index: PrefixIndex, kr: KeyedRequest, m: Match, h: LockHandle, positions: list[int], t: int
) -> None:
    b = index.block_tokens
    wanted = set(positions)
    for pos in sorted(p for p in wanted if p % b == 0 and 0 < p <= m.kv_tokens):
        index.admit_snapshot(m.kv_nodes[pos // b - 1], t)
    for i in range(len(m.kv_nodes), len(kr.keys)):
        node = index.insert_block(h, kr.keys[i], t, origin=t)
        if node is None:
            return  # budget full of locked entries: the rest is not cached
        if node.end_tokens in wanted:
            index.admit_snapshot(node, t)
    end = kr.req.cacheable_tokens
    tail = kr.tail_key
    if end in wanted and end % b and tail is not None and h.node.end_tokens == end // b * b:
        index.admit_partial(h, tail, end % b, t, origin=t)


def _serve(
    index: PrefixIndex,
    policy: object,
    cost: CostModel,
    kr: KeyedRequest,
    t: int,
    stats: RunStats,
    oracle: BeladyOracle | None,
) -> None:
    req = kr.req
    index.now = t
    m = index.match(kr.keys, req.prompt_tokens - 1, kr.probe)
    stats.requests += 1
    stats.prompt_tokens += req.prompt_tokens
    stats.hit_tokens += m.hit_tokens
    stats.state_hits += m.hit_tokens > 0
    stats.flops_total += cost.span_flops(0, req.prompt_tokens)
    saved = cost.span_flops(0, m.hit_tokens)
    stats.flops_saved += saved
    if oracle is not None:
        target = m.hit_node.key if m.hit_tokens else None
        oracle.record(t, [n.key for n in m.kv_nodes], target)
    tip = m.kv_nodes[-1] if m.kv_nodes else index.root
    h = index.lock(tip)
    index.touch(m, t)
    if index.promote(m, t):
        stats.host_hits += 1
        stats.host_hit_tokens += m.hit_tokens
        stats.host_flops_saved += saved
    ctx = AdmitContext(
        t,
        req.prompt_tokens,
        req.cacheable_tokens,
        m.hit_tokens,
        m.kv_tokens,
        not tip.is_leaf,
        index.block_tokens,
        req.exact_end,
        kr.key_at,
        kr.probe,
    )
    policy.observe(ctx, m.hit_node)  # type: ignore[attr-defined]
    positions = policy.snapshot_positions(ctx)  # type: ignore[attr-defined]
    _commit(index, kr, m, h, positions, t)
    index.unlock(h)


def replay(
    requests: Sequence[KeyedRequest],
    cost: CostModel,
    policy: object,
    budget_bytes: int,
    *,
    name: str | None = None,
    oracle: BeladyOracle | None = None,
    check_every: int = 0,
    progress: ProgressFn | None = None,
    host_bytes: int = 0,
    host_bandwidth: float = 25e9,
) -> RunStats:
    """Replay ``requests``; ``oracle`` (if given) records future uses for a Belady run;
    ``check_every`` > 0 runs ``check_integrity()`` every that many requests (slow);
    ``host_bytes`` > 0 adds a host tier of that size, ``host_bandwidth`` bytes/s each way."""
    host = HostTier(host_bytes, host_bandwidth) if host_bytes > 0 else None
    index = PrefixIndex(
        block_tokens=cost.block_tokens,
        kv_bytes_per_token=cost.kv_bytes_per_token,
        snapshot_bytes=cost.snapshot_bytes,
        budget_bytes=budget_bytes,
        policy=policy,  # type: ignore[arg-type]
        host=host,
    )
    stats = RunStats(
        name or getattr(policy, "name", "?"), budget_bytes, host_budget_bytes=host_bytes
    )
    started = time.perf_counter()
    for t, kr in enumerate(requests):
        _serve(index, policy, cost, kr, t, stats, oracle)
        if index.peak_bytes > budget_bytes:
            raise BudgetViolation(f"{stats.policy}: peak {index.peak_bytes} > {budget_bytes}")
        if host is not None and host.peak_bytes > host_bytes:
            raise BudgetViolation(f"{stats.policy}: host peak {host.peak_bytes} > {host_bytes}")
        if check_every and t % check_every == 0:
            index.check_integrity()
        if progress is not None:
            progress(t + 1, len(requests))
    stats.seconds = time.perf_counter() - started
    stats.snapshots_taken = index.snapshots_admitted
    stats.snapshots_kept = index.n_snapshots
    stats.evicted_kv_blocks = index.evicted_kv_blocks
    stats.evicted_snapshots = index.evicted_snapshots
    stats.peak_bytes = index.peak_bytes
    if host is not None:
        stats.demoted = host.demoted
        stats.host_dropped = host.dropped
        stats.host_invalidated = host.invalidated
        stats.host_peak_bytes = host.peak_bytes
        stats.promote_seconds = host.promote_seconds
    return stats
