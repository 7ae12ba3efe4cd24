"""The snapshot budget (``max_snapshot_fraction``) in a vLLM engine (CPU): tiny Zamba2, a
32-block pool of which free cached states may hold 6 pages (2 snapshots of its 3 Mamba groups).

Oracles: greedy outputs == caching off, token for token; the budget held after every scheduler
step (``debug``: the mirror's invariants, the budget among them: ``PrefixIndex`` inv 8);
the budget did evict (so the check was exercised) and hits still happened.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import engine
from tests.engine.test_host_tier_engine import POOL, run
from vllm_hybrid.adapters.vllm.metrics import hybrid_totals
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine


def test_snapshot_budget_holds_and_keeps_outputs(model_root) -> None:
    model_dir = tiny_model_dir("zamba2", model_root)
    with engine(model_dir, enable_prefix_caching=False, **POOL) as llm:
        reference, _ = run(llm)

    settings = {"policy": "flop", "debug": True, "max_snapshot_fraction": 0.2}
    with engine(
        model_dir, enable_prefix_caching=True, additional_config={"vllm_hybrid": settings}, **POOL
    ) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        pool = sched.hybrid_pool
        mirror = pool.hybrid.mirror
        assert mirror.snapshot_budget_pages == int(0.2 * pool.num_gpu_blocks) == 6
        got, cached = run(llm)
        assert got == reference
        assert cached > 0  # snapshots within the budget still serve hits
        assert pool.hybrid.budget_pages > 0  # the budget evicted (and was checked at every step)
        assert sched.hybrid_checks > 20
        assert mirror.free_state_pages() <= 6
        assert hybrid_totals(pool)["snapshot_budget_evicted_pages"] == pool.hybrid.budget_pages
