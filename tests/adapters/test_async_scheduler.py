"""``HybridAsyncScheduler`` and vLLM's ``AsyncScheduler`` stepped as vLLM 0.32.0's
``EngineCore.step_with_batch_queue`` steps them under async scheduling (``schedule()`` of step
n+1 before ``update_from_output()`` of step n), with a fake model that reads and writes the
blocks it is given (``vllm_hybrid/testing/sched_harness.py``). No engine, no GPU: vLLM's CPU
backend forces ``async_scheduling=False``, so no engine here ever runs these classes.

Scenarios: shared prefixes, repeated prompts and next turns (prefix hits, end-of-output
states), a pool small enough to evict and preempt, aborts between steps and at
``_process_aborts_queue``, ``cache_salt``, chunked prefill (``max_num_batched_tokens`` 48 below
most prompts), ``reset_prefix_cache`` with running requests, breakpoints and pins, sub-block
hits (``prefix_match_unit`` 1 and 4, with copy-on-write block copies).

Oracles: every output equals the fake model's expected sequence (so stock == ours == prefix
caching off); the hybrid pool's integrity after every ``schedule``, ``update_from_output``,
abort and reset; every hit's blocks hold the request's block hashes; no block a step uses is
free in the pool, none written by two requests of a step, no ``ref_cnt`` below 0.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from vllm_hybrid.testing.fixtures import model_cache_root, tiny_model_dir
from vllm_hybrid.testing.sched_harness import (
    EngineLoop,
    Spec,
    build_scheduler,
    expected_output,
    make_conversations,
    make_workload,
    run_workload,
)

BLOCK = 16
BATCHED = 48
POLICIES = ("flop", "vllm", "sglang", "marconi", "lru-dense")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir("zamba2", model_cache_root(tmp_path_factory.mktemp("models")))


@pytest.fixture(autouse=True)
def _settings_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only ``additional_config`` decides the hybrid settings here (no stray environment)."""
    for var in list(os.environ):
        if var.startswith("VLLM_HYBRID_") and var != "VLLM_HYBRID_MODEL_CACHE":
            monkeypatch.delenv(var)


def run(
    model_dir: Path,
    specs: list[Spec],
    kind: str,
    *,
    prefix_caching: bool = True,
    num_blocks: int = 24,
    mamba_groups: int = 2,
    policy: str = "flop",
    resets: frozenset[int] = frozenset(),
    prefix_match_unit: int | None = None,
) -> EngineLoop:
    sched, hasher = build_scheduler(
        kind,
        model_dir,
        prefix_caching=prefix_caching,
        block_tokens=BLOCK,
        num_blocks=num_blocks,
        mamba_groups=mamba_groups,
        max_batched_tokens=BATCHED,
        policy=policy,
        prefix_match_unit=prefix_match_unit,
    )
    assert sched.vllm_config.max_concurrent_batches == 2  # the async batch queue depth
    loop = run_workload(EngineLoop(sched, hasher), specs, resets=resets)
    check_outputs(loop, specs, mamba_groups)
    return loop


def check_outputs(loop: EngineLoop, specs: list[Spec], mamba_groups: int) -> None:
    """Oracle 1: finished requests got exactly the expected output, aborted ones a prefix of
    it; nothing left in the scheduler."""
    for spec in specs:
        want = expected_output(spec.prompt, spec.max_tokens, BLOCK, mamba_groups)
        got = loop.outputs[spec.req_id]
        if spec.req_id in loop.aborted:
            assert got == want[: len(got)], spec.req_id
        else:
            assert got == want, spec.req_id
            assert str(loop.finish[spec.req_id]) in ("length", "FinishReason.LENGTH")
    assert not loop.sched.requests and not loop.queue


def exercised(loop: EngineLoop, specs: list[Spec]) -> dict[str, Any]:
    salted = {s.req_id for s in specs if s.cache_salt}
    return {
        "hits": sum(n > 0 for n in loop.cached_tokens.values()),
        "salted_hits": sum(h.req_id in salted for h in loop.hits),
        "preemptions": loop.preemptions,
        "aborted": len(loop.aborted),
        "aborted_in_flight": sum(0 < len(loop.outputs[r]) for r in loop.aborted),
        "chunked": sum(len(s.prompt) > BATCHED for s in specs),
    }


MIXED = make_workload(1, 40, block_tokens=BLOCK, mamba_groups=2)


@pytest.mark.parametrize("policy", POLICIES)
def test_hybrid_async_mixed_workload(model_dir: Path, policy: str) -> None:
    """Prefix hits, evictions, preemptions, aborts, salts and chunked prefill at once, with
    the debug checks after every step; all outputs as expected."""
    loop = run(model_dir, MIXED, "hybrid", policy=policy)
    sched = loop.sched
    pool = sched.hybrid_pool
    assert pool is not None and pool.hybrid.debug
    seen = exercised(loop, MIXED)
    assert seen["hits"] >= 5 and seen["salted_hits"] >= 1, seen
    assert seen["preemptions"] >= 3 and seen["aborted_in_flight"] >= 2, seen
    assert seen["chunked"] >= 10, seen
    assert pool.hybrid.evict_calls > 0  # the pool was full: the policy picked victims
    # the scheduler's own debug checks (schedule + update_from_output) and the harness's
    assert sched.hybrid_checks >= 2 * loop.steps - 2
    assert loop.hybrid_checks >= sched.hybrid_checks


def test_stock_async_and_no_caching_agree(model_dir: Path) -> None:
    """The same stream through vLLM's own ``AsyncScheduler`` with and without prefix caching:
    the same outputs (the harness's oracles hold for vLLM's scheduler too), and hits only
    with caching."""
    cached = run(model_dir, MIXED, "stock")
    assert exercised(cached, MIXED)["hits"] >= 5
    assert getattr(cached.sched, "hybrid_pool", None) is None
    uncached = run(model_dir, MIXED, "stock", prefix_caching=False, num_blocks=40)
    assert not uncached.hits and not any(uncached.cached_tokens.values())
    ours = run(model_dir, MIXED, "hybrid")
    finished = [s.req_id for s in MIXED if s.req_id not in ours.aborted]
    for req_id in finished:
        assert ours.outputs[req_id] == cached.outputs[req_id] == uncached.outputs[req_id]


@pytest.mark.parametrize("mamba_groups", [1, 2])
@pytest.mark.parametrize("num_blocks", [32, 64])
def test_hybrid_async_next_turns(model_dir: Path, num_blocks: int, mamba_groups: int) -> None:
    """Conversations: each turn's prompt is the previous prompt + its answer + a message, so
    hits reach past the previous prompt into blocks and states written during decode (where
    async scheduling runs a step ahead of the outputs)."""
    specs = make_conversations(2, 5, 3, block_tokens=BLOCK, mamba_groups=mamba_groups, gap=40)
    loop = run(model_dir, specs, "hybrid", num_blocks=num_blocks, mamba_groups=mamba_groups)
    prompts = {s.req_id: len(s.prompt) for s in specs}
    past_answer_start = [
        h
        for h in loop.hits
        if int(h.req_id[1:]) >= 5 and h.tokens > prompts[f"r{int(h.req_id[1:]) - 5}"]
    ]
    assert len(past_answer_start) >= 3, loop.hits


def test_hybrid_async_salts_do_not_share(model_dir: Path) -> None:
    """The same prompt under three salts and none: each (salt, prompt) hits only its own
    blocks (the hit check compares against the salted block hashes)."""
    prompt = make_workload(3, 1, block_tokens=BLOCK)[0].prompt + list(range(100, 140))
    salts = [None, "a", "b", None, "a", "b"]
    specs = [Spec(f"r{i}", prompt, 4, 6 * i, salt) for i, salt in enumerate(salts)]
    loop = run(model_dir, specs, "hybrid", num_blocks=64)
    hits = {h.req_id for h in loop.hits}
    assert hits == {"r3", "r4", "r5"}, loop.hits


@pytest.mark.parametrize("kind", ["stock", "hybrid"])
def test_async_reset_prefix_cache_with_running_requests(model_dir: Path, kind: str) -> None:
    """``reset_prefix_cache(reset_running_requests=True)`` between steps (twice back to back,
    then later): every running request is preempted with its in-flight output dropped and may
    resume in the very next ``schedule()``; outputs stay as expected."""
    loop = run(model_dir, MIXED, kind, num_blocks=40, resets=frozenset({8, 9, 20, 33, 50}))
    assert loop.resets == 5 and loop.preemptions >= 10
    assert exercised(loop, MIXED)["hits"] >= 5


@pytest.mark.parametrize("policy", ["flop", "vllm"])
def test_hybrid_async_cache_control(model_dir: Path, policy: str) -> None:
    """Per-request cache control under async scheduling: breakpoints (chunks end at them),
    pins taken at finish and holding blocks while the pool is under pressure, reports; with
    a reset of running requests in the middle."""
    specs = make_workload(1, 40, block_tokens=BLOCK, mamba_groups=2, cache_options=True)
    assert sum(bool(s.extra_args) for s in specs) >= 10
    loop = run(model_dir, specs, "hybrid", policy=policy, num_blocks=40, resets=frozenset({30}))
    totals = loop.sched.hy_control.totals()
    assert totals["breakpoint_stops"] > 0 and totals["pins_taken"] > 0, totals
    assert loop.preemptions >= 10 and exercised(loop, specs)["hits"] >= 5


@pytest.mark.parametrize("kind", ["stock", "hybrid"])
@pytest.mark.parametrize("unit", [1, 4])
def test_async_sub_block_hits(model_dir: Path, kind: str, unit: int) -> None:
    """``prefix_match_unit`` below the block: hits end inside a block, the shared tail block is
    copied (``kv_cache_block_copies``, applied by the fake worker before the step) and the
    Mamba state at the exact hit position is read; with cache control and a reset."""
    specs = make_workload(0, 60, block_tokens=BLOCK, mamba_groups=2, cache_options=True)
    loop = run(model_dir, specs, kind, prefix_match_unit=unit, resets=frozenset({30}))
    assert loop.sched.kv_cache_manager.block_pool.hash_block_size == unit
    assert loop.worker.copies > 0
    assert sum(h.tokens % BLOCK != 0 for h in loop.hits) >= 3, loop.hits
