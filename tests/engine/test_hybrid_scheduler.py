"""HybridScheduler on a tiny Zamba2 with a pool small enough to force eviction.

Oracles: greedy outputs with the core's policy choosing victims == outputs with caching off,
token for token; the mirror equals vLLM's hash map and free queue after every scheduler step
(``VLLM_HYBRID_DEBUG=1``); evictions happened and hits were served.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import engine, greedy, vllm
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

SCHED = "vllm_hybrid.adapters.vllm.scheduler.HybridScheduler"
SMALL_POOL = {
    "num_gpu_blocks_override": 48,
    "max_model_len": 2048,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,  # prefills are chunked
}


def workload(seed: int, vocab: int = 1000) -> list[list[list[int]]]:
    """Waves of requests over a few shared prefixes (system prompts), each with its own tail."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [draw(rng.choice((256, 300, 384, 512))) for _ in range(4)]
    waves = []
    for _ in range(4):
        wave = [rng.choice(prefixes) + draw(rng.randrange(20, 200)) for _ in range(5)]
        waves.append(wave)
    return waves


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def run_waves(llm, waves):
    return [greedy(llm, wave, max_tokens=6) for wave in waves]


@pytest.fixture(scope="module")
def reference(model_root):
    """Greedy outputs of the waves with prefix caching off."""
    model_dir = tiny_model_dir("zamba2", model_root)
    with engine(model_dir, enable_prefix_caching=False, **SMALL_POOL) as llm:
        return [[o.outputs[0].token_ids for o in w] for w in run_waves(llm, workload(seed=3))]


@pytest.mark.parametrize("policy", ["flop", "vllm"])
def test_policy_eviction_keeps_outputs(policy, reference, model_root, monkeypatch):
    model_dir = tiny_model_dir("zamba2", model_root)
    waves = workload(seed=3)

    monkeypatch.setenv("VLLM_HYBRID_POLICY", policy)
    monkeypatch.setenv("VLLM_HYBRID_DEBUG", "1")
    with engine(model_dir, enable_prefix_caching=True, scheduler_cls=SCHED, **SMALL_POOL) as llm:
        sched = scheduler_of(llm)
        pool = sched.hybrid_pool
        assert pool is not None and pool.hybrid.mirror.policy.name == policy
        outs = run_waves(llm, waves)
        assert [[o.outputs[0].token_ids for o in w] for w in outs] == reference
        assert sched.hybrid_checks > 10  # integrity held at every step
        assert pool.hybrid.policy_pages > 0  # the policy chose victims
        assert sum(o.num_cached_tokens for w in outs for o in w) > 0  # and hits were served


def drive(llm, prompts, max_tokens, abort_at=None):
    """Step the engine by hand; abort the requests in ``abort_at[1]`` at step ``abort_at[0]``.
    Returns {request id: output tokens} of the requests that finished."""
    engine_ = llm.llm_engine
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine_.add_request(str(i), {"prompt_token_ids": p}, params)
    done, step = {}, 0
    while engine_.has_unfinished_requests():
        step += 1
        if abort_at and step == abort_at[0]:
            engine_.abort_request(abort_at[1])
        for out in engine_.step():
            if out.finished and out.outputs and out.outputs[0].finish_reason == "length":
                done[out.request_id] = list(out.outputs[0].token_ids)
    return done


def test_preemption_and_aborts_keep_outputs(model_root, monkeypatch):
    """Decode past the pool (preemption) and abort some requests mid-flight."""
    model_dir = tiny_model_dir("zamba2", model_root)
    rng = random.Random(7)
    prefix = [rng.randrange(10, 1000) for _ in range(300)]
    prompts = [prefix + [rng.randrange(10, 1000) for _ in range(40 + 30 * i)] for i in range(8)]
    pool = {"num_gpu_blocks_override": 20, "max_model_len": 1024, "max_num_seqs": 8}
    aborted = ["1", "4"]
    with engine(model_dir, enable_prefix_caching=False, **pool) as llm:
        reference = drive(llm, prompts, max_tokens=200)

    monkeypatch.setenv("VLLM_HYBRID_POLICY", "flop")
    monkeypatch.setenv("VLLM_HYBRID_DEBUG", "1")
    # Siblings waiting for the first one's prefix state share its KV and never fill this
    # pool; the fuzzer (tests/engine/test_fuzz.py) covers preemption with them waiting.
    monkeypatch.setenv("VLLM_HYBRID_SIBLING_WAIT", "0")
    with engine(model_dir, enable_prefix_caching=True, scheduler_cls=SCHED, **pool) as llm:
        sched = scheduler_of(llm)
        preemptions = []
        preempt = sched._preempt_request
        sched._preempt_request = lambda req, *a, **k: (
            preemptions.append(req),
            preempt(req, *a, **k),
        )[1]
        got = drive(llm, prompts, max_tokens=200, abort_at=(5, aborted))
        assert set(got) == set(reference) - set(aborted)
        assert all(got[k] == reference[k] for k in got)
        assert preemptions, "the pool was meant to force preemption"
        assert sched.hybrid_checks > 50
        assert sched.hybrid_pool.hybrid.policy_pages > 0
