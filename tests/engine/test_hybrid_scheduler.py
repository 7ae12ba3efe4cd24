"""HybridScheduler on a tiny Zamba2 with a pool small enough to force eviction.

Oracles: greedy outputs with the core's policy choosing victims == outputs with caching off,
token for token; the mirror equals vLLM's hash map and free queue after every scheduler step
(``VLLM_HYBRID_DEBUG=1``); evictions happened and hits were served.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import engine, greedy
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

SCHED = "vllm_hybrid.adapters.vllm.scheduler.HybridScheduler"
SMALL_POOL = {"num_gpu_blocks_override": 48, "max_model_len": 2048, "max_num_seqs": 4}


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
        assert pool is not None and pool._hy_mirror.policy.name == policy
        outs = run_waves(llm, waves)
        assert [[o.outputs[0].token_ids for o in w] for w in outs] == reference
        assert sched.hybrid_checks > 10  # integrity held at every step
        assert pool.hy_policy_pages > 0  # the policy chose victims
        assert sum(o.num_cached_tokens for w in outs for o in w) > 0  # and hits were served
