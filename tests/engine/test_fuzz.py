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


@pytest.mark.parametrize("arch, seed, n_requests", [("zamba2", 11, 20), ("nemotron_h", 13, 16)])
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


def test_fuzz_breakpoints_sub_block(model_root):
    """Half the requests carry cache_breakpoints at random positions, with a prefix match unit
    below the block (16, then 1): chunks end exactly at the U-floored breakpoints, sub-block
    states and partial KV entries are registered there (cache_control.exact_stops); outputs ==
    caching off at both units (one reference run). Zamba2."""
    model_dir = tiny_model_dir("zamba2", model_root)
    plan = make_plan(11, n_requests=24, breakpoint_rate=0.5)
    with engine(model_dir, enable_prefix_caching=False, **PRESSURE) as llm:
        reference = run_plan(llm, plan)
    debug = {"additional_config": {"vllm_hybrid": {"debug": True}}}
    for unit in (16, 1):
        with engine(
            model_dir, enable_prefix_caching=True, prefix_match_unit=unit, **PRESSURE, **debug
        ) as llm:
            tested = run_plan(llm, plan)
            control = llm.llm_engine.engine_core.engine_core.scheduler.hy_control
            assert control.stop_tokens == unit and control.breakpoint_stops > 0
        compared, mismatched = compare(reference, tested)
        assert mismatched == [], f"prefix_match_unit={unit}"
        assert compared >= 12
        assert any(v % 128 for v in tested.cached_tokens.values())  # sub-block hits happened


def test_fuzz_next_turns_scheduled_before_their_turn(model_root):
    """A third of the requests are preceded in their step by their own next turn, with a pool
    large enough that both resume from one cached sub-block state (one-token match unit, the
    default): the chained copy-on-write the worker must apply in order (``kv_copy``). With
    vLLM's gather copy, seed 11 gave one wrong output (r6)."""
    model_dir = tiny_model_dir("zamba2", model_root)
    plan = make_plan(11, n_requests=20, extension_first_rate=0.3)
    roomy = {**PRESSURE, "num_gpu_blocks_override": 128}
    with engine(model_dir, enable_prefix_caching=False, **roomy) as llm:
        reference = run_plan(llm, plan)
    debug = {"additional_config": {"vllm_hybrid": {"debug": True}}}
    with engine(model_dir, enable_prefix_caching=True, **roomy, **debug) as llm:
        tested = run_plan(llm, plan)
    compared, mismatched = compare(reference, tested)
    assert mismatched == []
    assert compared >= 20
    assert any(r.startswith("x") and tested.cached_tokens.get(r) for r in tested.finished)


@pytest.mark.parametrize("policy", ["flop", "stock"])
def test_mamba_block_holding_a_mid_block_state_is_not_hashed_as_full(model_root, policy):
    """Seed 202's three requests (``tools/fuzz_engine.py`` found it): ``r0`` (128 tokens) is
    decoding when ``x1`` (259) resumes at its prompt-end state 127 and runs past 128 in one
    chunk, so its Mamba block 0 keeps the state at 127; vLLM hashed that block as the state at
    128 and ``r1`` (165 tokens) resumed from it, answering [1017, 857] instead of [1476, 1666],
    under vLLM's own cache (``stock``) too. ``compat.keep_mid_block_mamba_states_unhashed``
    leaves such a block unhashed, so ``r1`` resumes at 127."""
    model_dir = tiny_model_dir("zamba2", model_root)
    plan = [
        e
        for e in make_plan(202, n_requests=200, extension_first_rate=0.1)
        if e.request_id in ("r0", "x1", "r1")
    ]
    with engine(model_dir, enable_prefix_caching=False, **PRESSURE) as llm:
        reference = run_plan(llm, plan)
    # x1 resumes at r0's prompt-end state at 127 (P - 1: exact_prompt_end, off by default).
    config = {
        "vllm_hybrid": {"policy": policy, "debug": policy != "stock", "exact_prompt_end": True}
    }
    with engine(
        model_dir,
        enable_prefix_caching=True,
        prefix_match_unit=1,
        **PRESSURE,
        additional_config=config,
    ) as llm:
        tested = run_plan(llm, plan)
    assert compare(reference, tested) == (3, [])
    assert tested.cached_tokens["x1"] == 127 and tested.cached_tokens["r1"] == 127
