"""Sub-block ("partial") prefix hits on Nemotron-H: greedy outputs equal caching off.

With a prefix match unit U below the 128-token block, a prompt that shares 112 tokens with an
earlier one hits at 112: the Mamba state at 112 is resumed, and the attention block holding
tokens 0..127 is copied into a private block (copy-on-write) before the new tokens 112.. are
written into it. vLLM 0.32.0's worker copy (``copy_kv_cache_blocks_inplace``,
vllm/v1/worker/utils.py) copies each KV cache allocation through the first view listed at its
address; on Nemotron-H (layer 0 is Mamba) that is a Mamba state view covering only the first
37,376 of the page's 131,072 bytes, so most of the copied attention block stayed zero and the
outputs changed. Zamba2 lists its attention layers first and was not affected. The plugin
replaces the copy (``kv_copy.patch_kv_cache_block_copies``; its unit tests, vLLM's bug on
every layout included, are ``tests/adapters/test_kv_copy.py``); these engine tests pin down the
outputs.
"""

from __future__ import annotations

import random

import pytest

from tests.engine.conftest import engine, vllm
from vllm_hybrid.testing.fixtures import tiny_model_dir

SETTINGS = {
    "num_gpu_blocks_override": 40,
    "max_num_seqs": 6,
    "max_num_batched_tokens": 256,
    "max_model_len": 2048,
}


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


def _counting_steps(llm) -> list[int]:
    """A list that gets one entry (tokens scheduled) per non-empty scheduler step."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    steps: list[int] = []
    schedule = scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        if out.total_num_scheduled_tokens:
            steps.append(out.total_num_scheduled_tokens)
        return out

    scheduler.schedule = counted
    return steps


@pytest.mark.engine
def test_exact_prompt_end_off_saves_the_tail_pass_and_stays_exact(model_root):
    """``exact_prompt_end: false`` (one-token unit): a prompt whose last chunk starts in its
    last block is computed to its end in one pass instead of stopping one token short
    (compat.extend_past_prompt_tail), so no state is kept at P - 1 and an exact repeat resumes
    lower; greedy outputs equal caching off either way, and the cache stays sound (debug)."""
    model_dir = tiny_model_dir("zamba2", model_root)
    rng = random.Random(7)
    a = [rng.randrange(10, 1000) for _ in range(300)]  # floor stop at 256, tail at 299
    prompts = [a, list(a), a[:280] + [rng.randrange(10, 1000) for _ in range(90)]]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)

    def run(llm):
        return [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in prompts]

    with engine(model_dir, enable_prefix_caching=False, **SETTINGS) as llm:
        reference = [list(o.outputs[0].token_ids) for o in run(llm)]
    got = {}
    for keep in (True, False):
        config = {"vllm_hybrid": {"debug": True, "exact_prompt_end": keep}}
        with engine(
            model_dir, enable_prefix_caching=True, **SETTINGS, additional_config=config
        ) as llm:
            assert llm.llm_engine.vllm_config.cache_config.prefix_match_unit == 1
            steps = _counting_steps(llm)
            outs = run(llm)
            scheduler = llm.llm_engine.engine_core.engine_core.scheduler
            assert scheduler.hybrid_checks > 0
        assert [list(o.outputs[0].token_ids) for o in outs] == reference, keep
        got[keep] = ([o.num_cached_tokens for o in outs], len(steps))
    (hits_on, steps_on), (hits_off, steps_off) = got[True], got[False]
    assert hits_on[:2] == [0, 299]  # vLLM's tail state at P - 1
    assert hits_off[:2] == [0, 256]  # the floor stop's state (core.prompt_floor_stop)
    assert hits_on[2] == hits_off[2] == 256  # a sibling sharing 280: the floor state
    assert steps_off < steps_on


@pytest.mark.engine
def test_request_and_its_extension_resume_together_from_one_partial_state(model_root):
    """A next turn scheduled before its own previous turn, both resuming from one sub-block
    state in one step (requests arriving over HTTP in either order: the cluster slow test found
    it). The extension's CoW fills a fresh block for the 640..767 block and caches it as a full
    block; the base request's partial hit at 729 lands on that block, so the worker gets the
    chain ``old -> x, x -> y``. vLLM 0.32.0 copied it as one gather (``y`` got ``x``'s stale
    bytes) and the base request's fourth token differed; ``kv_copy`` applies the pairs in
    order. Zamba2, the default one-token match unit."""
    model_dir = tiny_model_dir("zamba2", model_root)
    rng = random.Random(5)
    draw = lambda n: [rng.randrange(10, 1000) for _ in range(n)]  # noqa: E731
    first = draw(730)  # keeps its state at P - 1 = 729, inside the 640..767 block
    base = first + draw(100)
    extension = base + draw(90)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    settings = {"num_gpu_blocks_override": 128, "max_model_len": 2048}

    def run(llm):
        engine_ = llm.llm_engine
        llm.generate([{"prompt_token_ids": first}], params, use_tqdm=False)
        engine_.add_request("ext", {"prompt_token_ids": extension}, params)  # scheduled first
        engine_.add_request("base", {"prompt_token_ids": base}, params)
        done = {}
        while engine_.has_unfinished_requests():
            for out in engine_.step():
                if out.finished:
                    done[out.request_id] = (list(out.outputs[0].token_ids), out.num_cached_tokens)
        return done

    with engine(model_dir, enable_prefix_caching=False, **settings) as llm:
        reference = run(llm)
    # Both resume at the first turn's P - 1 state (exact_prompt_end, off by default).
    config = {"vllm_hybrid": {"debug": True, "exact_prompt_end": True}}
    with engine(model_dir, enable_prefix_caching=True, **settings, additional_config=config) as llm:
        tested = run(llm)
    assert tested["ext"][1] == tested["base"][1] == 729  # both resumed in the same step
    assert tested["base"][0] == reference["base"][0]
    assert tested["ext"][0] == reference["ext"][0]


@pytest.mark.engine
def test_default_prompt_end_keeps_one_token_prefill_chunks_off_the_decode_kernels(model_root):
    """At the defaults (one-token unit, ``exact_prompt_end: false``) a prompt with a floor stop
    (core.prompt_floor_stop) ends its prefill in one chunk, and its output equals caching off.
    With ``exact_prompt_end: true`` the last chunk stopped at P - 1 and the prompt's last token
    ran as a one-token step, which vLLM's CPU backend computes with its decode kernels: on
    request 18 of gen:prefix at scale 1 (small Zamba2, seed 0) that flips the first greedy
    token (1606 vs 431), and so does caching off with ``max_num_batched_tokens = P - 1``
    (docs/reliability.md). Found by `bench replay --trace gen:prefix --scale 1 --time-scale 0
    --max-num-seqs 1` on 2026-12-06."""
    import itertools

    from vllm_hybrid.bench.workload import build_workload, iter_source
    from vllm_hybrid.testing.make_model import build_model

    model_dir = build_model("zamba2", model_root / "zamba2-small-s0", "small", 0, "float32")
    reqs = build_workload(itertools.islice(iter_source("gen:prefix", 0), 19), 19, 1.0, 4096, 4)
    prompt = list(reqs[18].prompt_token_ids)
    assert len(prompt) == 1152
    params = vllm.SamplingParams(temperature=0.0, max_tokens=4)
    kwargs = {"num_gpu_blocks_override": 300, "max_num_seqs": 1, "max_model_len": 4096}

    def first(**extra):
        with engine(model_dir, **kwargs, **extra) as llm:
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            return list(out.outputs[0].token_ids)

    reference = first(enable_prefix_caching=False)
    config = {"vllm_hybrid": {"debug": True}}
    assert first(enable_prefix_caching=True, additional_config=config) == reference
