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
    sa, sb, sa2 = sim_requests([_req(0, a), _req(1, b), _req(2, a)], B)
    assert sa.segments[0] == sb.segments[0] and sa.segments[1] != sb.segments[1]
    # the prompt's blocks, then the 3 answer tokens the engine computes (4 generated)
    assert [n for _, n in sa.segments] == [16, 16, 16, 2, 3]
    assert sa.prompt_tokens == 50 and sa.cacheable_tokens == 53
    assert sa.segments[-1] != sb.segments[-1]  # answers of different prompts differ
    assert sa2.segments == sa.segments  # greedy: one prompt, one answer
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


def test_engine_in_flight_counts_requests_in_the_engine_at_each_arrival() -> None:
    from vllm_hybrid.bench.predict import engine_in_flight

    assert engine_in_flight([], [], 16) == 1
    assert engine_in_flight([0.0, 1.0, 2.0], [0.5, 0.5, 0.5], 16) == 1  # never overlap
    # all at once, each lasting past the last arrival: 1, 2, 3, 4 in the engine -> mean 2.5
    assert engine_in_flight([0.0, 0.1, 0.2, 0.3], [9.0] * 4, 16) == 3
    assert engine_in_flight([0.0, 0.1, 0.2, 0.3], [9.0] * 4, 2) == 2  # the rest queue


def test_in_flight_prediction_hides_a_request_in_flight_and_holds_its_pages() -> None:
    from vllm_hybrid.bench.predict import running_bytes

    a = list(range(100, 150))
    reqs = [_req(0, a), _req(1, a)]
    assert running_bytes(LAYOUT) == 4 * 4096  # running state (3 groups) + last partial block
    # Visible to the next request: the same 48 tokens as one at a time.
    assert predict_hit_rate(reqs, LAYOUT, "stock", in_flight=2) == 48 / 100
    # A 16-page pool: at most 2 requests in flight (their 2 x 4 running pages leave half of it
    # to the cache), so 16 asked for runs as 2 instead of failing, and A's 6 pages still fit.
    tiny = PoolLayout(16, B, 4096, 1, 3, "zamba2")
    assert predict_hit_rate(reqs, tiny, "stock") == 48 / 100
    assert predict_hit_rate(reqs, tiny, "stock", in_flight=16) == 48 / 100


def test_the_in_flight_count_is_the_one_the_simulator_runs_with() -> None:
    """``bench replay`` stores and prints ``sim_in_flight``: the engine's count capped by the
    pool (the agent row printed 6 while the simulator ran 4)."""
    from vllm_hybrid.bench.predict import sim_in_flight

    # 17 blocks: 16 usable next to vLLM's null block; 2 x 4 running pages leave half of them
    tiny = PoolLayout(17, B, 4096, 1, 3, "zamba2")
    assert tiny.cache_bytes() == 16 * 4096
    assert [sim_in_flight(tiny, n) for n in (0, 1, 2, 3, 16)] == [1, 1, 2, 2, 2]
    assert sim_in_flight(LAYOUT, 3) == 3


def test_bench_rows_store_the_count_the_simulator_ran_with() -> None:
    from vllm_hybrid.bench.replay import add_predictions
    from vllm_hybrid.bench.report import RequestRecord, RowResult

    a = list(range(100, 150))
    reqs = [_req(i, a) for i in range(4)]
    tiny = PoolLayout(17, B, 4096, 1, 3, "zamba2")  # 16 usable pages
    # four requests all in the engine at once (each lasts past the last arrival): mean 2.5 -> 3
    records = [RequestRecord(i, 0.1 * i, 50, 0, 4, 1.0, 9.0, [1]) for i in range(4)]
    row = RowResult("stock", 17, 10.0, 1.0, records, layout=tiny.to_json())
    add_predictions([row], reqs, 16)
    assert row.sim_in_flight == 2  # the engine's 3, capped by the 16-page pool
    assert row.sim_hit_rate == predict_hit_rate(reqs, tiny, "stock", in_flight=2)


def test_engine_running_is_the_mean_count_at_first_scheduling() -> None:
    from vllm_hybrid.bench.predict import engine_running

    assert engine_running([]) is None and engine_running([None, None]) is None  # over HTTP
    assert engine_running([1, 2, 3, None]) == 2  # a request without the count is left out
    assert engine_running([2, 3, 3, 3]) == 3  # 2.75 rounds up
    assert engine_running([0]) == 1  # at least one


def test_offline_rows_predict_with_the_schedulers_count_not_the_arrivals() -> None:
    """The agent row: all four requests in the engine at each arrival (arrival count 3), but
    the pool let only one run at a time (running_at_start 1): the simulator runs 1 in flight."""
    from vllm_hybrid.bench.replay import add_predictions
    from vllm_hybrid.bench.report import RequestRecord, RowResult

    a = list(range(100, 150))
    reqs = [_req(i, a) for i in range(4)]
    records = [RequestRecord(i, 0.1 * i, 50, 0, 4, 1.0, 9.0, [1], 1) for i in range(4)]
    row = RowResult("stock", 64, 10.0, 1.0, records, layout=LAYOUT.to_json())
    add_predictions([row], reqs, 16)
    assert row.sim_in_flight == 1
    assert row.sim_hit_rate == predict_hit_rate(reqs, LAYOUT, "stock", in_flight=1)


def test_engine_admission_is_align_mode_plus_the_answer_ends_the_policy_keeps() -> None:
    from vllm_hybrid.core.policies import POLICIES, EngineAdmission
    from vllm_hybrid.core.policy import AdmitContext

    cost = LAYOUT.cost_model()

    def ctx(prompt: int, computed: int, hit: int = 0, kv: int = 0) -> AdmitContext:
        return AdmitContext(0, prompt, computed, hit, kv, False, B, False, lambda p: p)

    flop = EngineAdmission(POLICIES["flop"](cost), B)
    vllm = EngineAdmission(POLICIES["vllm"](cost), B)
    # prompt 30 tokens + 5 computed answer tokens: the replay boundary 16, the answer's 32
    assert sorted(flop.snapshot_positions(ctx(30, 35))) == [16, 32]
    assert vllm.snapshot_positions(ctx(30, 35)) == [16]  # vLLM keeps no answer state
    assert sorted(flop.snapshot_positions(ctx(30, 31, hit=16, kv=16))) == [16]  # no boundary
    assert sorted(vllm.snapshot_positions(ctx(40, 40, hit=16, kv=32))) == [32, 32]  # junction
    # one-token unit, a pool roomy enough for the optional stops: the prompt floor (16) and
    # the prompt's own end (30, core.prompt_end_stop) besides the answer's exact end (34)
    exact = EngineAdmission(POLICIES["flop"](cost), 1, lambda prompt: True)
    exact_ctx = AdmitContext(0, 30, 35, 0, 0, False, B, True, lambda p: p)
    assert exact.snapshot_positions(exact_ctx) == [16, 30, 35]
    # without them one chunk computes the prompt, which exports vLLM's checkpoint at P - 1
    tight = EngineAdmission(POLICIES["flop"](cost), 1, lambda prompt: False)
    assert tight.snapshot_positions(exact_ctx) == [29, 35]


def test_warm_up_requests_teach_the_policy_as_in_the_engine(monkeypatch) -> None:
    """With ``warmup``, the prediction replays the warm-ups, then the workload on a fresh pool
    (the engine resets its prefix cache after warming up) with the same policy object, whose
    clock goes on from there."""
    import vllm_hybrid.bench.predict as predict
    from vllm_hybrid.bench.workload import warmup_requests

    a, c = list(range(100, 150)), list(range(300, 340))
    reqs = [_req(0, a), _req(1, c), _req(2, a), _req(3, c + [9] * 20)]
    warm = warmup_requests(reqs, 2)
    assert len(warm) == 2 and warm[0].prompt_token_ids != warm[1].prompt_token_ids
    assert warmup_requests(reqs, 2) == warm  # seeded: the engine ran these very ids
    assert {len(w.prompt_token_ids) for w in warm} == {50}  # the workload's median prompt
    calls = []
    real = predict.replay

    def recording(keyed, cost, policy, budget, **kw):
        calls.append((len(keyed), kw["first_index"], policy))
        return real(keyed, cost, policy, budget, **kw)

    monkeypatch.setattr(predict, "replay", recording)
    predict.predict_hit_rate(reqs, LAYOUT, "flop", warmup=2)
    assert [(n, first) for n, first, _ in calls] == [(2, 0), (4, 2)]
    assert calls[0][2] is calls[1][2]
    calls.clear()
    predict.predict_hit_rate(reqs, LAYOUT, "flop")
    assert [(n, first) for n, first, _ in calls] == [(4, 0)]


def test_engine_waiting_counts_the_later_requests_arrived_by_the_first_token() -> None:
    from vllm_hybrid.bench.predict import engine_waiting

    assert engine_waiting([0.0, 0.0, 0.0], [5.0, 1.0, 1.0]) == [2, 1, 0]  # all at once
    assert engine_waiting([0.0, 1.0, 5.0], [2.0, 0.5, 1.0]) == [1, 0, 0]
    assert engine_waiting([], []) == []
    # out of order: the run stops at the first later request that had not arrived
    assert engine_waiting([0.0, 9.0, 1.0], [2.0, 1.0, 1.0]) == [0, 1, 0]


def test_the_prediction_lets_running_requests_release_the_states_they_passed(monkeypatch) -> None:
    # vLLM's align mode frees a running request's state blocks once it has computed past them
    # (MambaManager.remove_skipped_blocks), so the prediction does not hold them
    # (replay(hold_snapshots=False)), one at a time and in flight, for every row.
    import vllm_hybrid.bench.predict as predict

    seen: list[bool] = []
    real = predict.replay

    def spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        seen.append(kwargs.get("hold_snapshots", True))
        return real(*args, **kwargs)

    monkeypatch.setattr(predict, "replay", spy)
    a = list(range(100, 150))
    for policy in ("stock", "flop"):
        predict_hit_rate([_req(0, a), _req(1, a)], LAYOUT, policy)
        predict_hit_rate([_req(0, a), _req(1, a)], LAYOUT, policy, in_flight=2)
    assert seen == [False] * 4


def test_the_prediction_leaves_vllms_null_block_out() -> None:
    # A repeat needs A's 3 KV pages and its 3-page state: 6 pages. vLLM takes one block as
    # its null block (BlockPool.null_block), so 7 blocks hold them and 6 do not.
    a = list(range(100, 150))
    reqs = [_req(0, a), _req(1, a)]
    fits = PoolLayout(7, B, 4096, 1, 3, "zamba2")
    short = PoolLayout(6, B, 4096, 1, 3, "zamba2")
    assert predict_hit_rate(reqs, fits, "stock") == 48 / 100
    assert predict_hit_rate(reqs, short, "stock") == 0.0


def test_sibling_stops_are_modelled_for_the_running_slots_left() -> None:
    """Two prompts that arrive together and diverge at 40 tokens (inside block 2): an engine
    with a free running slot ends the first one's chunk at 40 and keeps its state there
    (``sibling_wait``, ``core.sibling_stops``), so the second resumes at 40; with no slot
    beside the first (``max_num_seqs`` 1, or not given) it takes no stop and the second
    finds no state below 40."""
    shared = list(range(100, 140))
    reqs = [_req(0, shared + [1] * 20), _req(1, shared + [2] * 20)]
    waiting = [1, 0]
    hits: dict[int | None, list[int]] = {}
    for seqs in (None, 1, 2):
        out: list[int] = []
        predict_hit_rate(reqs, LAYOUT, "flop", 1, 0, waiting, out, match_unit=1, max_num_seqs=seqs)
        hits[seqs] = out
    assert hits[2] == [0, 40]
    assert hits[None] == hits[1] and hits[1][1] < 40
    stock: list[int] = []
    predict_hit_rate(reqs, LAYOUT, "stock", 1, 0, waiting, stock, max_num_seqs=2)
    assert stock[1] < 40  # vLLM's own cache: no sibling stops
