"""Align-mode prefix caching on vLLM's CPU backend with the plugin's ops, per architecture.

Oracles: greedy outputs with caching == without caching (token for token, also with chunked
prefill), hits are reported, and the uncached engine's first tokens == transformers (fp32).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.conftest import engine, greedy, shared_prefix_prompts
from vllm_hybrid.testing import cpu_archs
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

#: Every family vLLM's CPU backend runs in float32: the four Mamba2 hybrids, Jamba (Mamba1, with
#: the plugin's selective scan), the gated delta
#: nets (Qwen3-Next, Qwen3.5 dense and MoE, with the plugin's gated delta rule) and LFM2 (dense
#: and MoE; exact since ``compat.flatten_cpu_rotary_inputs``). One representative per family in
#: CI: the MoE twins of Qwen3.5 (a minute each with the sequential rule) are slow.
SLOW_ARCHS = {"qwen3_5_moe"}
FP32_ARCHS = [
    pytest.param(arch, marks=pytest.mark.slow) if arch in SLOW_ARCHS else arch
    for arch in cpu_archs()
]


def transformers_greedy(model_dir, prompts, max_tokens, dtype="float32"):
    from vllm_hybrid.testing.make_model import load_transformers_model

    model = load_transformers_model(model_dir, dtype=getattr(torch, dtype)).eval()
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            gen = model.generate(
                ids, max_new_tokens=max_tokens, do_sample=False, attention_mask=torch.ones_like(ids)
            )
            outs.append(gen[0, len(prompt) :].tolist())
    return outs


@pytest.mark.parametrize("arch", FP32_ARCHS)
def test_cached_equals_uncached_and_transformers(arch, model_root):
    model_dir = tiny_model_dir(arch, model_root)
    vocab = 1000
    prompts = shared_prefix_prompts(seed=1, vocab=vocab)

    with engine(model_dir, enable_prefix_caching=False) as llm:
        reference = [o.outputs[0].token_ids for o in greedy(llm, prompts)]

    # max_num_batched_tokens below the prompt length: prefills are chunked
    with engine(model_dir, enable_prefix_caching=True, max_num_batched_tokens=256) as llm:
        first = greedy(llm, prompts)
        second = greedy(llm, prompts)

    for outs in (first, second):
        assert [o.outputs[0].token_ids for o in outs] == reference
    # the repeat and the shared-prefix prompts hit on the first pass, everything on the second
    assert first[4].num_cached_tokens > 0
    assert all(o.num_cached_tokens > 0 for o in second)
    assert all(o.num_cached_tokens < len(p) for o, p in zip(second, prompts, strict=True))

    hf = transformers_greedy(model_dir, prompts[:2], max_tokens=4)
    assert [list(r[:4]) for r in reference[:2]] == hf
