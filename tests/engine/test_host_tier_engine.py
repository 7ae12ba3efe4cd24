"""The host tier in a vLLM engine (CPU): tiny Zamba2, a pool small enough that the policy
evicts snapshots alone, a host tier of a few slots.

Oracles: greedy outputs == caching off, token for token (a promote that copied the wrong
bytes, or none, changes them: skipping the worker's promote copies was checked to fail this);
host promotes happened and served hits; the mirror, the host tier's invariants (H1, H2) and its
slot map hold after every scheduler step (``debug``).
"""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import engine, greedy
from vllm_hybrid.adapters.vllm.host_connector import HybridHostTierConnector
from vllm_hybrid.adapters.vllm.metrics import hybrid_totals
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

POOL = {
    "num_gpu_blocks_override": 32,
    "max_model_len": 2048,
    "max_num_seqs": 4,
    "max_num_batched_tokens": 256,  # prefills are chunked
}
#: 12 slots of the tiny Zamba2's 219,648-byte snapshot (3 Mamba layers of 73,216 state bytes)
HOST_GB = 0.0027


def workload(seed: int = 5, vocab: int = 1000) -> list[list[list[int]]]:
    """Waves over a few shared prefixes (system prompts), each request with its own tail."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefixes = [draw(rng.choice((256, 300, 384))) for _ in range(4)]
    return [
        [rng.choice(prefixes) + draw(rng.randrange(20, 120)) for _ in range(5)] for _ in range(3)
    ]


def run(llm) -> tuple[list[list[list[int]]], int]:
    tokens, cached = [], 0
    for wave in workload():
        outs = greedy(llm, wave, max_tokens=4)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        cached += sum(o.num_cached_tokens for o in outs)
    return tokens, cached


def test_host_promotes_keep_outputs(model_root) -> None:
    model_dir = tiny_model_dir("zamba2", model_root)
    with engine(model_dir, enable_prefix_caching=False, **POOL) as llm:
        reference, _ = run(llm)

    settings = {"policy": "flop", "debug": True, "host_tier_gb": HOST_GB}
    with engine(
        model_dir,
        enable_prefix_caching=True,
        additional_config={"vllm_hybrid": settings},
        **POOL,
    ) as llm:
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        assert isinstance(sched.connector, HybridHostTierConnector)  # selected by the plugin
        pool = sched.hybrid_pool
        host = pool.hybrid.host
        assert host is not None and host.num_slots == 12
        got, cached = run(llm)
        assert got == reference
        tier = host.tier
        assert tier.demoted > 0 and tier.promoted > 0, vars(tier)
        assert cached > 0
        assert sched.hybrid_checks > 20  # mirror + host invariants held at every step (54 checks)
        totals = hybrid_totals(pool)  # the metrics path (docs/metrics.md)
        assert totals["host_promotes"] == tier.promoted and totals["host_demotes"] == tier.demoted
        assert totals["host_bytes"] == len(tier) * tier.snapshot_bytes
        # the worker (in this process) ran every copy the ledger ordered
        from vllm.distributed.kv_transfer import get_kv_transfer_group

        assert get_kv_transfer_group().ops_run == tier.demoted + tier.promoted
