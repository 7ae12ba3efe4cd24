"""Every entry a request caches carries its index (``Node.origin``), the one its lookup was fed
with, including the blocks ``KVCacheManager.allocate_slots`` caches at scheduling time (before
the step's output is fed): a learning policy (``flop``) ranks an entry by how often content its
inserter's class inserted was reused, as the simulator's replay (same index per request) does.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hybrid.testing.fixtures import model_cache_root, tiny_model_dir
from vllm_hybrid.testing.sched_harness import EngineLoop, Spec, build_scheduler, run_workload

BLOCK = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_model_dir("zamba2", model_cache_root(tmp_path_factory.mktemp("models")))


def test_what_a_request_caches_carries_its_index(model_dir: Path) -> None:
    # a big enough step budget: each prompt is prefilled (and its blocks cached) in one step
    sched, hasher = build_scheduler("hybrid", model_dir, block_tokens=BLOCK, max_batched_tokens=256)
    loop = EngineLoop(sched, hasher)
    prompts = [list(range(100, 100 + 3 * BLOCK + 5)), list(range(500, 500 + 4 * BLOCK + 2))]
    specs = [Spec(f"r{i}", p, 3, i * 40) for i, p in enumerate(prompts)]
    indexes: dict[str, int] = {}
    feed = sched.hybrid_pool.hybrid.feed
    started = feed.started

    def record(index, prompt_tokens, *args):  # the index each request was fed with
        indexes[f"r{len(indexes)}"] = index
        return started(index, prompt_tokens, *args)

    feed.started = record
    run_workload(loop, specs)
    mirror = sched.hybrid_pool.hybrid.mirror
    for spec in specs:
        request = sched.requests.get(spec.req_id)
        assert request is None  # finished; its blocks stay cached (free)
        hashes = hasher(_request(spec))
        origins = {mirror.node_of(h).origin for h in hashes if mirror.node_of(h) is not None}
        assert origins == {indexes[spec.req_id]}, (spec.req_id, origins, indexes)
    assert indexes["r0"] < indexes["r1"]


def _request(spec: Spec):
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    return Request(spec.req_id, spec.prompt, SamplingParams(max_tokens=1), None, block_hasher=None)
