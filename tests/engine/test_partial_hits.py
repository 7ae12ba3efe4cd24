"""Sub-block ("partial") prefix hits on Nemotron-H: greedy outputs equal caching off.

With a prefix match unit U below the 128-token block, a prompt that shares 112 tokens with an
earlier one hits at 112: the Mamba state at 112 is resumed, and the attention block holding
tokens 0..127 is copied into a private block (copy-on-write) before the new tokens 112.. are
written into it. vLLM 0.32.0's worker copy (``copy_kv_cache_blocks_inplace``,
vllm/v1/worker/utils.py) copies each KV cache allocation through the first view listed at its
address; on Nemotron-H (layer 0 is Mamba) that is a Mamba state view covering only the first
37,376 of the page's 131,072 bytes, so most of the copied attention block stayed zero and the
outputs changed. Zamba2 lists its attention layers first and was not affected. The plugin
replaces the copy (``kv_copy.patch_kv_cache_block_copies``); these tests pin that down.
"""

from __future__ import annotations

import random

import pytest
import torch

from tests.engine.conftest import engine, vllm
from vllm_hybrid.adapters.vllm import kv_copy, version
from vllm_hybrid.testing.fixtures import tiny_model_dir

SETTINGS = {
    "num_gpu_blocks_override": 40,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 256,
    "max_model_len": 2048,
}


def aliased_views(blocks: int = 8, page: int = 64, layers: int = 2) -> list[torch.Tensor]:
    """The hybrid layout in small: one allocation of ``layers`` layer regions of ``blocks``
    pages; in layer 0, a Mamba-like int8 view of the first 24 bytes of every page is listed
    before an attention-like fp32 view of the whole page (both start at the same address)."""
    raw = torch.zeros(layers * blocks * page, dtype=torch.int8)
    layer0 = raw[: blocks * page]
    state = layer0.view(blocks, page)[:, :24].unsqueeze(1)
    kv = layer0.view(torch.float32).view(blocks, 2, page // 8)
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
    return [state, kv]


def test_copy_reaches_an_attention_view_behind_a_narrower_one():
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy

    views = aliased_views()
    kv, before = views[1], views[1].clone()
    kv_copy.copy_kv_cache_blocks_every_view(
        views, 8, [KVCacheBlockCopy(3, 6), KVCacheBlockCopy(1, 2)]
    )
    assert torch.equal(kv[6], before[3]) and torch.equal(kv[2], before[1])
    untouched = [b for b in range(8) if b not in (2, 6)]
    assert torch.equal(kv[untouched], before[untouched])


def test_copy_reads_every_source_before_writing():
    """A destination that is also a source is read before it is written (one indexed copy)."""
    views = aliased_views()
    kv, before = views[1], views[1].clone()
    kv_copy.copy_kv_cache_blocks_every_view(views, 8, [(3, 4), (4, 5)])
    assert torch.equal(kv[4], before[3]) and torch.equal(kv[5], before[4])


def test_vllm_copy_still_skips_the_aliased_view():
    """The bug the patch exists for, on the pinned vLLM: when this fails, vLLM fixed it and
    ``patch_kv_cache_block_copies`` can go."""
    assert version.check_vllm_version("the canary")  # vLLM is pinned to 0.32.0 exactly
    from vllm.v1.core.kv_cache_utils import KVCacheBlockCopy
    from vllm.v1.worker import utils as worker_utils

    copy = kv_copy.VLLM_KV_CACHE_BLOCK_COPY or worker_utils.copy_kv_cache_blocks_inplace
    assert copy is not kv_copy.copy_kv_cache_blocks_every_view
    views = aliased_views()
    kv, before = views[1], views[1].clone()
    copy(views, 8, [KVCacheBlockCopy(3, 6)])
    assert not torch.equal(kv[6], before[3])


def test_patch_replaces_the_runner_copy():
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    import vllm.v1.worker.utils as worker_utils

    assert kv_copy.patch_kv_cache_block_copies()
    assert kv_copy.patch_kv_cache_block_copies()
    ours = kv_copy.copy_kv_cache_blocks_every_view
    assert worker_utils.copy_kv_cache_blocks_inplace is ours
    assert gpu_model_runner.copy_kv_cache_blocks_inplace is ours


def _prompts(seed: int) -> tuple[list[int], list[int]]:
    """A (120 tokens), then B: A's first 112 tokens and 28 new ones (hits 112 at U = 16)."""
    rng = random.Random(seed)
    a = [rng.randrange(10, 1000) for _ in range(120)]
    return a, a[:112] + [rng.randrange(10, 1000) for _ in range(28)]


@pytest.mark.engine
def test_nemotron_h_sub_block_hit_equals_caching_off(model_root):
    """Before the fix: B's first logprob -0.552 (caching off) vs -1.169 (cached), and the
    greedy tokens diverged."""
    model_dir = tiny_model_dir("nemotron_h", model_root)
    a, b = _prompts(1000)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)

    def run(llm):
        llm.generate([{"prompt_token_ids": a}], params, use_tqdm=False)
        return llm.generate([{"prompt_token_ids": b}], params, use_tqdm=False)[0]

    with engine(model_dir, enable_prefix_caching=False, **SETTINGS) as llm:
        reference = run(llm)
    for policy in ("stock", "flop"):  # vLLM's own cache, then ours
        config = {"additional_config": {"vllm_hybrid": {"policy": policy}}}
        with engine(
            model_dir, enable_prefix_caching=True, prefix_match_unit=16, **SETTINGS, **config
        ) as llm:
            tested = run(llm)
        assert tested.num_cached_tokens == 112, policy  # a sub-block hit happened
        want, got = reference.outputs[0], tested.outputs[0]
        assert list(got.token_ids) == list(want.token_ids), policy
        assert [next(iter(d.values())).logprob for d in got.logprobs] == [
            next(iter(d.values())).logprob for d in want.logprobs
        ], policy
