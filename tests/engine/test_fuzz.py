"""CI subset of the differential fuzzer: caching on with the hybrid cache (small pool: eviction,
preemption, chunked prefill, aborts, n > 1, stop tokens) == caching off, for every request that
finished in both; the cache's integrity is checked after every scheduler step."""

from __future__ import annotations

import pytest

from tests.engine.conftest import engine
from vllm_hybrid.testing.fixtures import tiny_model_dir
from vllm_hybrid.testing.fuzz import compare, make_plan, run_plan

pytestmark = pytest.mark.engine

PRESSURE = {
    "num_gpu_blocks_override": 40,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 256,
    "max_model_len": 2048,
}


@pytest.mark.parametrize("arch, seed, n_requests", [("zamba2", 11, 20), ("nemotron_h", 12, 16)])
def test_fuzz_cached_equals_uncached(arch, seed, n_requests, model_root):
    model_dir = tiny_model_dir(arch, model_root)
    plan = make_plan(seed, n_requests=n_requests)
    with engine(model_dir, enable_prefix_caching=False, **PRESSURE) as llm:
        reference = run_plan(llm, plan)
    # No scheduler_cls: the plugin selects the hybrid cache; debug checks its integrity per step.
    debug = {"additional_config": {"vllm_hybrid": {"debug": True}}}
    with engine(model_dir, enable_prefix_caching=True, **PRESSURE, **debug) as llm:
        tested = run_plan(llm, plan)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        assert scheduler.hybrid_pool is not None and scheduler.hybrid_checks > 0
    compared, mismatched = compare(reference, tested)
    assert mismatched == []
    assert compared >= n_requests // 2
    assert sum(tested.cached_tokens.values()) > 0
