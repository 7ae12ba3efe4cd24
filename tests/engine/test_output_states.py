"""End-of-output states: the next turn of a conversation resumes from the end of the answer.

One engine per prefix match unit ``U`` (tiny Zamba2, 128-token blocks, the ``flop`` policy,
integrity checks after every scheduler step): our default (``match_unit: auto``, ``U`` = 1) and
vLLM's (``match_unit: block``, ``U`` = the block). A greedy chat of four turns
whose answers cross a block boundary while decoding: vLLM 0.32 alone keeps no state there
(``MambaManager.reachable_block_mask`` keeps only prompt ends and junctions), so each turn
resumed from the block below the previous *prompt's* end; with ``OutputStates``
(``adapters/vllm/cache_control.py``) it resumes from the block below the end of the previous
*answer*. Oracles:

* every turn's ``num_cached_tokens`` is exactly the highest state the policy keeps: the
  ``U``-floor of the previous turn's prompt + answer (the last computed position);
* greedy outputs equal outputs computed from scratch: the same requests each under a fresh
  ``cache_salt`` (which shares no cached block), token for token;
* the superseded boundary states of a long answer are dropped (one end state per answer).
"""

from __future__ import annotations

import random
import uuid

import pytest

from tests.engine.conftest import engine, vllm
from vllm_hybrid.adapters.vllm.metrics import hybrid_totals
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

BLOCK = 128
ANSWER = 40  # tokens per answer: each answer below crosses a block boundary while decoding


#: The prefix match unit each engine runs with, by its ``match_unit`` setting.
UNIT = {"auto": 1, "block": BLOCK}


@pytest.fixture(scope="module", params=sorted(UNIT))
def llm(request, model_root):
    # exact_prompt_end (off by default): these tests place prompt-end states at P - 1.
    config = {
        "vllm_hybrid": {
            "policy": "flop",
            "debug": True,
            "match_unit": request.param,
            "exact_prompt_end": True,
        }
    }
    with engine(
        tiny_model_dir("zamba2", model_root),
        enable_prefix_caching=True,
        num_gpu_blocks_override=128,
        additional_config=config,
    ) as llm:
        unit = llm.llm_engine.vllm_config.cache_config.prefix_match_unit or BLOCK
        assert unit == UNIT[request.param]
        llm.unit = unit
        yield llm


def _params() -> object:
    return vllm.SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)


def _generate(llm, prompt: list[int], salt: str | None = None):
    item: dict = {"prompt_token_ids": prompt}
    if salt is not None:
        item["cache_salt"] = salt
    return llm.generate([item], _params(), use_tqdm=False)[0]


def _floor(tokens: int, unit: int = BLOCK) -> int:
    return tokens // unit * unit


def _conversation() -> tuple[random.Random, list[int]]:
    """The conversation's start; each turn adds 20 new tokens, then the answer (prompts 610,
    670, 730, 790, 850; the last computed positions 649, 709, 769, 829, 889)."""
    rng = random.Random(11)
    conversation = [rng.randrange(10, 1000) for _ in range(590)]
    return rng, conversation


def test_next_turn_resumes_from_the_end_of_the_answer(llm):
    rng, conversation = _conversation()
    kept: list[int] = []  # the states the engine should hold for this conversation
    turns = []  # (prompt, num_cached_tokens, expected, answer)
    for _ in range(5):
        conversation = conversation + [rng.randrange(10, 1000) for _ in range(20)]
        out = _generate(llm, conversation)
        answer = list(out.outputs[0].token_ids)
        assert len(answer) == ANSWER
        prompt_tokens = len(conversation)
        expected = max((p for p in kept if p <= prompt_tokens - 1), default=0)
        turns.append((prompt_tokens, out.num_cached_tokens, expected, answer))
        computed = prompt_tokens + ANSWER - 1  # the last sampled token is never computed
        # prompt end, answer end
        kept += [_floor(prompt_tokens - 1, llm.unit), _floor(computed, llm.unit)]
        conversation = conversation + answer
    hits = [(p, got) for p, got, _, _ in turns]
    assert [got for _, got, _, _ in turns] == [want for _, _, want, _ in turns], hits
    # U = block: vLLM alone gives 0, 512, 640, 640, 768 (the previous prompt's end); the
    # answers of turns 1 and 3 crossed 640 and 768 while decoding. U = 1: the exact ends.
    want = {1: [0, 649, 709, 769, 829], BLOCK: [0, 640, 640, 768, 768]}[llm.unit]
    assert [got for _, got, _, _ in turns] == want, hits

    # Outputs equal from-scratch outputs (a fresh salt per request: no cached block shared).
    rng, conversation = _conversation()
    for _, _, _, answer in turns:
        conversation = conversation + [rng.randrange(10, 1000) for _ in range(20)]
        reference = _generate(llm, conversation, salt=uuid.uuid4().hex)
        assert reference.num_cached_tokens == 0
        assert list(reference.outputs[0].token_ids) == answer
        conversation = conversation + answer


def test_a_long_answer_keeps_one_end_state(llm):
    """An answer crossing two block boundaries keeps the last one only; the next turn hits
    it, and a prompt that stops at the earlier boundary finds no state there."""
    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    output = scheduler.hy_output
    assert output is not None
    rng = random.Random(12)
    prompt = [rng.randrange(10, 1000) for _ in range(300)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=300, ignore_eos=True)
    before = (output.kept_boundaries, output.dropped)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    answer = list(out.outputs[0].token_ids)
    computed = 300 + 300 - 1  # 599: boundaries 384 and 512 crossed while decoding
    # U = 1: the exact end state at 599 is keyed at finish and replaces 512 as well
    exact = llm.unit < BLOCK
    assert (output.kept_boundaries - before[0], output.dropped - before[1]) == (2, 1 + exact)
    totals = hybrid_totals(scheduler.hybrid_pool)  # what /metrics exports
    assert totals["output_states_kept"] == output.kept_boundaries + output.kept_exact
    assert totals["output_states_dropped"] == output.dropped >= 1
    full = prompt + answer
    nxt = _generate(llm, full[:computed] + [rng.randrange(10, 1000) for _ in range(30)])
    assert nxt.num_cached_tokens == _floor(computed, llm.unit) == (599 if exact else 512)
    # 384 was an end only until 512 was crossed: a prompt ending just past it resumes from
    # the previous prompt's end (299, or 256 floored to the block) instead.
    early = _generate(llm, full[:390] + [rng.randrange(10, 1000) for _ in range(5)])
    assert early.num_cached_tokens == _floor(299, llm.unit)


def test_a_sibling_prompt_resumes_at_the_last_block_boundary(llm):
    """Two questions over one document (700 tokens + 50 of question): the second shares the
    first up to inside the first's last block, so it can only resume from a state at that
    block's start (640). vLLM keeps one there at U = the block; at U = 1 the prompt's own state
    is at its exact end (749), so the engine keeps the boundary too (core.prompt_floor_stop).
    Outputs equal from-scratch outputs."""
    rng = random.Random(13)
    document = [rng.randrange(10, 1000) for _ in range(700)]
    questions = [[rng.randrange(10, 1000) for _ in range(50)] for _ in range(3)]
    got = [_generate(llm, document + q) for q in questions]
    assert [o.num_cached_tokens for o in got] == [0, 640, 640]
    for q, out in zip(questions, got, strict=True):
        fresh = _generate(llm, document + q, salt=uuid.uuid4().hex)
        assert list(fresh.outputs[0].token_ids) == list(out.outputs[0].token_ids)


def test_a_shared_prefix_ending_inside_a_block_is_kept_exactly_once_revealed(llm):
    """Three prompts sharing their first 600 tokens (inside the 5th block), 60 tokens each
    after it. None can hit on the first reuse (no state below 600 was kept). The second
    reveals the junction: vLLM stops it at the block below (512); at U = 1 the index finds the
    exact junction inside the first prompt's block (PrefixIndex.shared_tokens), so the third
    resumes at 600. Outputs equal from-scratch outputs."""
    rng = random.Random(17)
    shared = [rng.randrange(10, 1000) for _ in range(600)]
    tails = [[rng.randrange(10, 1000) for _ in range(60)] for _ in range(3)]
    got = [_generate(llm, shared + t) for t in tails]
    want = [0, 0, 600] if llm.unit == 1 else [0, 0, 512]
    assert [o.num_cached_tokens for o in got] == want
    for t, out in zip(tails, got, strict=True):
        fresh = _generate(llm, shared + t, salt=uuid.uuid4().hex)
        assert list(fresh.outputs[0].token_ids) == list(out.outputs[0].token_ids)


def test_the_policy_decides_where_the_end_state_goes():
    """``core/policy.py::output_state_position`` (no engine): the end of the output, floored
    to the match unit and past the prompt, where the policy's admission keeps it."""
    from vllm_hybrid.core.cost import CostModel
    from vllm_hybrid.core.policies import POLICIES
    from vllm_hybrid.core.policy import output_state_position
    from vllm_hybrid.core.shapes import load_shape

    cost = CostModel(load_shape("zamba2-2.7b"), BLOCK)
    cases = ((661, BLOCK), (640, BLOCK), (661, 1), (661, 16), (639, BLOCK))
    got = {
        name: [output_state_position(cls(cost), 638, end, BLOCK, unit) for end, unit in cases]
        for name, cls in POLICIES.items()
    }
    assert got["flop"] == got["marconi"] == [640, 640, 661, 656, 0]
    assert got["vllm"] == [0, 0, 0, 0, 0]  # vLLM keeps no state inside the output
    # SGLang keeps one only at a decode-track boundary (a multiple of 256) past the prompt:
    # an answer from 638 to 661 crosses none
    assert got["sglang"] == [0, 0, 0, 0, 0]
