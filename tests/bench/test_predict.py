"""The simulator's prediction for a bench row: same token ids, pool and page costs."""

from __future__ import annotations

from vllm_hybrid.bench.predict import PoolLayout, predict_hit_rate, sim_requests
from vllm_hybrid.bench.workload import BenchRequest

B = 16
LAYOUT = PoolLayout(
    blocks=64, block_tokens=B, page_bytes=4096, kv_groups=1, state_groups=3, model_type="zamba2"
)


def _req(i: int, ids: list[int]) -> BenchRequest:
    return BenchRequest(i, float(i), tuple(ids), 4)


def test_block_keys_follow_token_prefixes() -> None:
    a = list(range(100, 150))  # 3 full blocks + 2 tokens
    b = a[:B] + [7] * 40  # shares only the first block
    sa, sb = sim_requests([_req(0, a), _req(1, b)], B)
    assert sa.segments[0] == sb.segments[0] and sa.segments[1] != sb.segments[1]
    assert [n for _, n in sa.segments] == [16, 16, 16, 2]
    assert not sa.exact_end


def test_a_repeat_hits_up_to_the_last_block_below_its_end() -> None:
    a = list(range(100, 150))
    reqs = [_req(0, a), _req(1, a)]
    # vLLM's replay boundary: (50 - 1) // 16 * 16 = 48 of the 100 prompt tokens.
    assert predict_hit_rate(reqs, LAYOUT, "stock") == 48 / 100
    assert predict_hit_rate(reqs, LAYOUT, "flop") == 48 / 100
    assert predict_hit_rate(reqs, LAYOUT, "off") is None  # not a policy the simulator runs


def test_layout_round_trips_and_counts_bytes_in_pages() -> None:
    assert PoolLayout.from_json(LAYOUT.to_json()) == LAYOUT
    cost = LAYOUT.cost_model()
    assert cost.kv_bytes_per_block == 4096 and cost.snapshot_bytes == 3 * 4096
