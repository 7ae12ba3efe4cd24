"""``sglang`` replayed on a Mooncake-format trace whose outputs never reappear (as the shared
trace's): it hits at the states its prefill chunks and branching points leave, and its KV stops
at its last state (SGLang's ``extra_buffer`` radix cache, ``core/sglang.py``)."""

import json

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.policies import POLICIES, SglangPolicy
from vllm_hybrid.core.shapes import load_shape
from vllm_hybrid.sim.replay import replay
from vllm_hybrid.sim.trace import KeyedRequest, load_mooncake

COST = CostModel(load_shape("marconi-7b"), 64)
SHARED = list(range(20))  # 20 blocks of 512 tokens: a 10,240-token shared prefix


def _trace(tmp_path, tails: list[tuple[int, int]]) -> list[KeyedRequest]:
    """One request per (first unique id, prompt length): the shared prefix, then ids of its
    own; no prompt ends on a 512-token block, so no prompt's end reappears later."""
    lines = []
    for t, (first_id, n_tokens) in enumerate(tails):
        n_ids = -(-n_tokens // 512)
        ids = SHARED + list(range(first_id, first_id + n_ids - len(SHARED)))
        lines.append(
            json.dumps(dict(timestamp=t, input_length=n_tokens, output_length=9, hash_ids=ids))
        )
    path = tmp_path / "mooncake.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return [KeyedRequest(r, 64) for r in load_mooncake(path)]


def test_sglang_hits_a_shared_prefix_whose_prompts_end_apart(tmp_path) -> None:
    """The first request keeps states at 8192 (end of its first 8k chunk) and 12,288 (its last
    grid point); the second hits 8192, recomputes from there and keeps its branching point
    10,240 (the KV match's end) instead of its chunk's end; the third hits 10,240. Keeping a
    state only at each sequence's end (the model this replaces) hits nothing here: no
    prompt's end is a prefix of a later prompt."""
    keyed = _trace(tmp_path, [(100, 12_300), (200, 14_000), (300, 11_000)])
    stats = replay(keyed, COST, SglangPolicy(COST), 10**12)
    assert stats.hit_tokens == 8192 + 10_240
    assert stats.state_hits == 2
    assert stats.snapshots_taken == 2 + 1 + 1  # [8192, 12288], [10240], [10944]


def test_sglang_keeps_no_kv_past_its_last_state(tmp_path) -> None:
    """The second request's last state is its branching point (10,240): its own 3,712 tokens
    of full blocks past it are not kept, where a policy keeping all its KV keeps them."""
    keyed = _trace(tmp_path, [(100, 12_300), (200, 14_000)])
    sglang = replay(keyed, COST, SglangPolicy(COST), 10**12)
    flop = replay(keyed, COST, POLICIES["flop"](COST), 10**12)
    per_token = COST.kv_bytes_per_token
    assert sglang.peak_bytes == 12_288 * per_token + 3 * COST.snapshot_bytes
    assert flop.peak_bytes >= (12_288 + 3_712) * per_token
