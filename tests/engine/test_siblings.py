"""Requests that arrive together with a shared prefix (core/siblings.py) on the engine."""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import engine, vllm
from vllm_hybrid.testing.make_model import build_model

PREFIX = 600  # inside block 4 of 128-token blocks: only an exact stop keeps a state there


def _prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(0)
    prefix = [rng.randrange(10, vocab) for _ in range(PREFIX)]
    return [prefix + [rng.randrange(10, vocab) for _ in range(60 + 23 * i)] for i in range(6)]


def _run(model_dir, prompts, **kwargs):
    params = vllm.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with engine(model_dir, **kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        control = getattr(scheduler, "hy_control", None)
        waits = control.sibling_waits if control is not None else 0
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return tokens, [o.num_cached_tokens for o in outs], waits


@pytest.mark.engine
def test_siblings_of_one_batch_resume_from_the_first_ones_state(model_root):
    """Six prompts sharing 600 tokens, submitted at once: with ``sibling_wait`` (the default)
    the first computes the prefix and keeps its state at 600, the five others wait for it and
    resume there; without it the second computes the prefix beside the first and the others
    resume at the block floor (512). Outputs equal caching off either way."""
    model_dir = build_model("zamba2", model_root / "zamba2-small-s0", "small", 0, "float32")
    prompts = _prompts(1900)
    reference, _, _ = _run(model_dir, prompts, enable_prefix_caching=False)
    debug = {"debug": True}
    out, cached, waits = _run(
        model_dir, prompts, enable_prefix_caching=True, additional_config={"vllm_hybrid": debug}
    )
    assert out == reference
    assert cached[0] == 0 and all(c >= PREFIX for c in cached[1:]), cached
    assert waits > 0
    config = {"vllm_hybrid": {**debug, "sibling_wait": False}}
    out, cached, waits = _run(
        model_dir, prompts, enable_prefix_caching=True, additional_config=config
    )
    assert out == reference
    assert cached[:2] == [0, 0] and max(cached) < PREFIX, cached
    assert waits == 0


@pytest.mark.engine
def test_requests_that_extend_a_whole_prompt_resume_at_its_end(model_root):
    """A 700-token prompt and two that extend all of it (next turns), submitted at once, in a
    pool too small for optional stops (80 blocks: no floor stop at 640,
    ``core.optional_snapshots_fit``): the two wait for the first one's prompt end, with no stop
    in its last block, which would cost vLLM's checkpoint at ``P - 1`` (a stop at 640 gave
    ``[0, 640, 640]``), and resume at ``P - 1``. Outputs equal caching off."""
    model_dir = build_model("zamba2", model_root / "zamba2-small-s0", "small", 0, "float32")
    rng = random.Random(1)
    base = [rng.randrange(10, 1900) for _ in range(700)]
    prompts = [base, base + [rng.randrange(10, 1900) for _ in range(50)], base + [11] * 80]
    reference, _, _ = _run(model_dir, prompts, enable_prefix_caching=False)
    out, cached, waits = _run(
        model_dir,
        prompts,
        enable_prefix_caching=True,
        num_gpu_blocks_override=80,
        additional_config={"vllm_hybrid": {"debug": True}},
    )
    assert out == reference
    assert cached == [0, len(base) - 1, len(base) - 1], cached
    assert waits > 0
