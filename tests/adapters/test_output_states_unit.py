"""``output_states.OutputStates``' stand-in for ``KVCacheCoordinator.cache_blocks``.

Off a block boundary past the prompt, the wrapper installed on the coordinator does what
vLLM 0.32.0's ``cache_blocks`` does itself (one Python frame fewer per call: vLLM calls it for
every scheduled request at every step). These tests pin what that relies on, and compare the
two on the same requests: every group's cached hashes after each call."""

from __future__ import annotations

import pytest

from vllm_hybrid.testing.fixtures import model_cache_root, tiny_model_dir
from vllm_hybrid.testing.sched_harness import build_scheduler


def test_replay_boundaries_without_eagle_is_the_prompts_last_token() -> None:
    from vllm.v1.core.kv_cache_coordinator import replay_boundaries

    for prompt in (1, 15, 16, 17, 100, 4096):
        for block in (16, 128):
            assert replay_boundaries(prompt, block, use_eagle=False) == (prompt - 1,)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model_dir("zamba2", model_cache_root(tmp_path_factory.mktemp("models")))


@pytest.fixture(params=[None, 0], ids=["dense", "interval-0"])
def pair(model, request):
    """Two hybrid schedulers; vLLM's retention interval None (a state at every block) or 0
    (prompt ends and replay boundaries only, where ``replay_boundaries`` decides)."""
    out = []
    for _ in range(2):
        sched, hasher = build_scheduler("hybrid", model, block_tokens=16, num_blocks=64)
        sched.kv_cache_manager.coordinator.retention_interval = request.param
        sched.kv_cache_config.prefix_cache_retention_interval = request.param
        out.append(sched)
    return out[0], out[1], hasher


def _hashes(sched) -> list[dict[str, tuple]]:
    """Per group, per request: the hash of each of its blocks (None: not in the prefix cache)."""
    return [
        {rid: tuple(b.block_hash for b in blocks) for rid, blocks in m.req_to_blocks.items()}
        for m in sched.kv_cache_manager.coordinator.single_type_managers
    ]


def test_the_wrapper_caches_what_vllms_cache_blocks_caches(pair) -> None:
    """Requests stepped by hand off block boundaries: the wrapper (``ours``) and vLLM's own
    method on a twin scheduler (``stock``: its wrapper removed) register the same blocks."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    ours, stock, hasher = pair
    stock_coord = stock.kv_cache_manager.coordinator
    assert stock.hy_output is not None and ours.hy_output is not None
    del stock_coord.cache_blocks  # the instance attribute: vLLM's method again
    assert stock_coord.cache_blocks.__func__ is type(stock_coord).cache_blocks
    for sched in (ours, stock):
        for i, n in enumerate((40, 37, 16, 32, 33)):
            prompt = [(7 * i + t) % 500 + 10 for t in range(n)]
            req = Request(
                request_id=f"r{i}",
                prompt_token_ids=prompt,
                sampling_params=SamplingParams(max_tokens=4),
                pooling_params=None,
                block_hasher=hasher,
            )
            sched.add_request(req)
    for step in range(6):
        for sched in (ours, stock):
            out = sched.schedule()
            assert out.total_num_scheduled_tokens > 0
        assert _hashes(ours) == _hashes(stock), f"step {step}"
        for sched in (ours, stock):
            for req_id in list(sched.requests):
                req = sched.requests[req_id]
                sched.kv_cache_manager.coordinator.cache_blocks(req, req.num_computed_tokens)
        assert _hashes(ours) == _hashes(stock)
