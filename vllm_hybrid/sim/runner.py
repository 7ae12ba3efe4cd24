"""Runs a set of policies at a set of budgets on one workload, with the two reference rows.

The infinite-cache run comes first: it gives the bound and records, for the clairvoyant Belady
reference, which request uses which block and which snapshot. ``marconi`` has its alpha tuned by
replaying the first window of the workload at the same budget (as the paper does). A host tier
(``host_bytes`` > 0) is given to every online policy; the two references run without one.
With ``sglang_pools`` > 0, ``sglang`` also runs with SGLang's two pools (row ``sglang-2pool``):
a Mamba pool of ``ratio / (1 + ratio)`` of the budget, the KV pool the rest.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_hybrid.core import (
    POLICIES,
    BeladyOracle,
    BeladyPolicy,
    CostModel,
    InfinitePolicy,
    MarconiPolicy,
    pool_split_bytes,
)
from vllm_hybrid.sim.replay import ProgressFn, RunStats, replay
from vllm_hybrid.sim.service import DEFAULT_THROUGHPUT
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest

MARCONI_ALPHAS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0)
SGLANG_POOLS = "sglang-2pool"  # the row of ``sglang`` with SGLang's two pools
UNBOUNDED_BYTES = 1 << 62


class UnknownPolicyError(ValueError):
    """A policy name that is not one of :data:`POLICIES`."""


def check_policies(names: Sequence[str]) -> list[str]:
    bad = [n for n in names if n not in POLICIES]
    if bad:
        raise UnknownPolicyError(
            f"unknown policy {', '.join(map(repr, bad))}; known: {', '.join(POLICIES)}"
        )
    return list(names)


@dataclass
class Results:
    """All rows of one workload: ``rows[budget_bytes][policy]``, plus the infinite bound."""

    workload: str
    shape: str
    block_tokens: int
    infinite: RunStats
    rows: dict[int, dict[str, RunStats]] = field(default_factory=dict)
    marconi_alpha: dict[int, float] = field(default_factory=dict)

    @property
    def throughput_flops(self) -> float:
        """The TTFT model's prefill FLOP/s (sim/service.py), the same for every row."""
        return self.infinite.throughput_flops


def tune_marconi_alpha(
    keyed: Sequence[KeyedRequest], cost: CostModel, budget_bytes: int, window: int
) -> float:
    """The alpha of the grid that saves the most FLOPs on the first ``window`` requests."""
    head = keyed[:window]
    scores = [
        (replay(head, cost, MarconiPolicy(cost, a, window), budget_bytes).flops_saved, -a)
        for a in MARCONI_ALPHAS
    ]
    return -max(scores)[1]


def _make(name: str, cost: CostModel, alpha: float, window: int) -> object:
    if name == "marconi":
        return MarconiPolicy(cost, alpha, window)
    return POLICIES[name](cost)


def run_all(
    requests: Sequence[SimRequest],
    cost: CostModel,
    budgets_bytes: Sequence[int],
    policies: Sequence[str],
    *,
    workload: str = "",
    progress: Callable[[str], ProgressFn | None] = lambda _: None,
    host_bytes: int = 0,
    host_bandwidth: float = 25e9,
    sglang_pools: float = 0.0,
    throughput_flops: float = DEFAULT_THROUGHPUT,
) -> Results:
    """Infinite bound, then every policy and Belady at every budget; ``sglang_pools``: the
    Mamba/KV ratio of SGLang's two pools for an extra ``sglang-2pool`` row (0: none);
    ``throughput_flops``: the prefill FLOP/s every row's TTFT is modelled with."""
    keyed = [KeyedRequest(r, cost.block_tokens) for r in requests]
    oracle = BeladyOracle()
    inf = replay(
        keyed,
        cost,
        InfinitePolicy(cost),
        UNBOUNDED_BYTES,
        oracle=oracle,
        progress=progress("infinite"),
        throughput_flops=throughput_flops,
    )
    res = Results(workload, cost.shape.name, cost.block_tokens, inf)
    window = max(50, len(keyed) // 10)
    for budget in budgets_bytes:
        row: dict[str, RunStats] = {}
        alpha = 1.0
        if "marconi" in policies:
            alpha = tune_marconi_alpha(keyed, cost, budget, window)
            res.marconi_alpha[budget] = alpha
        for name in policies:
            pol = _make(name, cost, alpha, window)
            row[name] = replay(
                keyed,
                cost,
                pol,
                budget,
                progress=progress(name),
                host_bytes=host_bytes,
                host_bandwidth=host_bandwidth,
                throughput_flops=throughput_flops,
            )
        if sglang_pools > 0 and "sglang" in policies:
            row[SGLANG_POOLS] = replay(
                keyed,
                cost,
                POLICIES["sglang"](cost),
                budget,
                progress=progress(SGLANG_POOLS),
                host_bytes=host_bytes,
                host_bandwidth=host_bandwidth,
                state_budget_bytes=pool_split_bytes(budget, sglang_pools)[1],
                throughput_flops=throughput_flops,
            )
        row["belady"] = replay(
            keyed,
            cost,
            BeladyPolicy(cost, oracle),
            budget,
            progress=progress("belady"),
            throughput_flops=throughput_flops,
        )
        res.rows[budget] = row
    return res
