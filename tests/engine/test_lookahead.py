"""The waiting requests' lookahead (``PrefixIndex.lookahead``, fed by the scheduler from
``Scheduler.waiting``) in a vLLM engine (CPU): tiny Zamba2, a 20-block pool, two requests in
flight, waves of five requests over shared prefixes, so requests wait while others evict.

Oracles: greedy outputs == caching off, token for token; the debug checks after every step
(the mirror's invariants, mirror == vLLM's map and free queue); the lookahead did pass units
over (so the path was exercised) and the pool never fell back to vLLM's LRU order.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import engine
from tests.engine.test_host_tier_engine import POOL, run
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

TWO_IN_FLIGHT = {**POOL, "max_num_seqs": 2, "num_gpu_blocks_override": 20, "max_model_len": 1024}


def test_lookahead_keeps_outputs_and_passes_units_over(model_root) -> None:
    model_dir = tiny_model_dir("zamba2", model_root)
    with engine(model_dir, enable_prefix_caching=False, **TWO_IN_FLIGHT) as llm:
        reference, _ = run(llm)

    settings = {"policy": "flop", "debug": True}
    with engine(
        model_dir,
        enable_prefix_caching=True,
        additional_config={"vllm_hybrid": settings},
        **TWO_IN_FLIGHT,
    ) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        pool = sched.hybrid_pool
        mirror = pool.hybrid.mirror
        assert mirror.lookahead is not None  # set by the scheduler
        refreshes: list[int] = []

        class Counting:  # the mirror, its refreshes counted (a compiled one takes no new attribute)
            def refresh_lookahead(self) -> None:
                refreshes.append(1)
                mirror.refresh_lookahead()

            def __getattr__(self, name: str) -> object:
                return getattr(mirror, name)

        pool.hybrid.mirror = Counting()
        schedules, schedule = [], sched.schedule
        sched.schedule = lambda *a, **k: (schedules.append(1), schedule(*a, **k))[1]  # type: ignore[method-assign]
        got, cached = run(llm)
        assert got == reference
        assert cached > 0
        assert pool.hybrid.mirror.stats.wanted_units > 0  # a waiting request's hit was kept
        assert pool.hybrid.policy_pages > 0 and pool.hybrid.fallback_pages == 0
        assert sched.hybrid_checks > 20
        assert len(schedules) > 10 and len(refreshes) == len(schedules)  # once per schedule()
