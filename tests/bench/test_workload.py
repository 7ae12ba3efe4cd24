"""Workload conversion: deterministic token ids, shared segments give shared prefixes, limits,
arrival scaling. Pure Python, no engine."""

from __future__ import annotations

import pytest

from vllm_hybrid.bench import BenchError
from vllm_hybrid.bench.workload import (
    TOKEN_HI,
    TOKEN_LO,
    build_workload,
    iter_source,
    materialize,
    scaled_arrivals,
    time_scale_for_rate,
)
from vllm_hybrid.sim.trace import SimRequest


def _req(segments: list[tuple[int, int]], arrival_ms: float = 0.0, out: int = 10) -> SimRequest:
    return SimRequest(arrival_ms, tuple(segments), sum(n for _, n in segments), out)


def test_materialize_is_deterministic_and_in_range() -> None:
    req = _req([(7, 100), (8, 50)])
    ids = materialize(req, 1.0)
    assert ids == materialize(req, 1.0)
    assert len(ids) == 150
    assert all(TOKEN_LO <= t < TOKEN_HI for t in ids)


def test_shared_segments_give_identical_token_prefixes() -> None:
    a = materialize(_req([(1, 400), (2, 100)]), 0.5)
    b = materialize(_req([(1, 400), (3, 100)]), 0.5)
    assert a[:200] == b[:200]
    assert a[200:] != b[200:]


def test_scale_and_prompt_budget() -> None:
    # Segments beyond the prompt (a later turn's output) are not part of the prompt.
    req = SimRequest(0.0, ((1, 100), (2, 100)), 120, 5)
    assert len(materialize(req, 1.0)) == 120
    assert len(materialize(req, 0.5)) == 60
    # a scaled segment is the start of the same segment at full length
    assert materialize(req, 0.5)[:50] == materialize(_req([(1, 100)]), 1.0)[:50]


def test_build_workload_is_deterministic_and_shares_prefixes() -> None:
    one = build_workload(iter_source("gen:chat"), 20, 0.25, 4096)
    two = build_workload(iter_source("gen:chat"), 20, 0.25, 4096)
    assert one == two
    assert [r.index for r in one] == list(range(20))
    assert one[0].arrival_s == 0.0
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(one, one[1:], strict=False))
    # chat has 8 system prompts for many sessions: some pair shares a 100-token prefix
    heads = [r.prompt_token_ids[:100] for r in one]
    assert len(set(heads)) < len(heads)


def test_other_seed_other_workload() -> None:
    a = build_workload(iter_source("gen:agent", seed=0), 5, 0.1, 4096)
    b = build_workload(iter_source("gen:agent", seed=1), 5, 0.1, 4096)
    assert a != b


def test_max_len_skips_and_cuts_outputs() -> None:
    reqs = [_req([(1, 100)], 0.0, out=50), _req([(2, 500)], 10.0), _req([(3, 90)], 20.0, out=50)]
    got = build_workload(iter(reqs), 10, 1.0, 120)
    assert [r.prompt_tokens for r in got] == [100, 90]
    assert [r.max_tokens for r in got] == [20, 30]  # prompt + output <= max_len
    assert [r.arrival_s for r in got] == [0.0, 0.02]
    fixed = build_workload(iter(reqs), 10, 1.0, 4096, max_tokens=3)
    assert [r.max_tokens for r in fixed] == [3, 3, 3]


def test_outputs_from_trace_are_scaled() -> None:
    got = build_workload(iter([_req([(1, 100)], out=40)]), 1, 0.25, 4096)
    assert got[0].max_tokens == 10


def test_nothing_fits_is_an_error() -> None:
    with pytest.raises(BenchError, match="no request fits"):
        build_workload(iter([_req([(1, 500)])]), 10, 1.0, 100)


def test_mooncake_blocks_share_tokens(mooncake_trace) -> None:
    got = build_workload(iter_source(str(mooncake_trace)), 10, 0.5, 4096)
    assert len(got) == 3  # the 9,000-token request is over max-len at scale 0.5
    a, b = got[0].prompt_token_ids, got[1].prompt_token_ids
    assert a[:256] == b[:256] and a[256:300] != b[256:300]
    assert (len(a), len(b)) == (350, 450)
    assert [r.arrival_s for r in got] == [0.0, 0.5, 1.5]


def test_rate_and_time_scale() -> None:
    reqs = build_workload(iter([_req([(i, 10)], 1000.0 * i) for i in range(5)]), 5, 1.0, 4096)
    scale = time_scale_for_rate(reqs, 2.0)  # 4 gaps in 4 s of trace -> 2/s means 2 s in all
    assert scale == pytest.approx(0.5)
    assert scaled_arrivals(reqs, scale) == pytest.approx([0.0, 0.5, 1.0, 1.5, 2.0])
    assert scaled_arrivals(reqs, 0.0) == [0.0] * 5
    with pytest.raises(BenchError):
        time_scale_for_rate(reqs, 0.0)


def test_load_window_scales_the_busiest_arrivals() -> None:
    # gaps of 4, 4, 1, 1, 4 s: the busiest 2 gaps span 2 s, all 5 span 14 s
    at = [0.0, 4.0, 8.0, 9.0, 10.0, 14.0]
    reqs = build_workload(
        iter([_req([(i, 10)], 1000.0 * t) for i, t in enumerate(at)]), 6, 1.0, 4096
    )
    assert time_scale_for_rate(reqs, 1.0) == pytest.approx(5 / 14)  # the mean: 1/s overall
    assert time_scale_for_rate(reqs, 1.0, window=2) == pytest.approx(1.0)  # 2 gaps in 2 s
    assert time_scale_for_rate(reqs, 1.0, window=3) == pytest.approx(3 / 6)  # 4+1+1 s
    assert time_scale_for_rate(reqs, 1.0, window=99) == time_scale_for_rate(reqs, 1.0)
    with pytest.raises(BenchError, match="--load-window must be >= 0"):
        time_scale_for_rate(reqs, 1.0, window=-1)
    burst = build_workload(
        iter([_req([(i, 10)], 0.0 if i < 3 else 5000.0) for i in range(5)]), 5, 1.0, 4096
    )
    with pytest.raises(BenchError, match="the busiest 2 arrivals come at one instant"):
        time_scale_for_rate(burst, 1.0, window=2)
    assert time_scale_for_rate(burst, 1.0, window=3) == pytest.approx(3 / 5)


def test_unknown_generator_and_missing_trace() -> None:
    with pytest.raises(BenchError, match="unknown generator 'nope'"):
        list(iter_source("gen:nope"))
    with pytest.raises(BenchError, match="trace file not found"):
        list(iter_source("/no/such/trace.jsonl"))


def test_skip_starts_at_a_later_window_with_its_own_clock() -> None:
    from argparse import Namespace

    from vllm_hybrid.bench.replay import load_workload

    args = Namespace(trace="gen:chat", seed=0, skip=0, requests=40, scale=0.25, max_len=4096)
    args.max_tokens = 4
    whole = load_workload(args)
    args.skip, args.requests = 10, 5
    window = load_workload(args)
    source = list(iter_source("gen:chat", 0))
    assert [r.prompt_token_ids for r in window] == [
        tuple(materialize(req, 0.25)) for req in source[10:15]
    ]
    assert window[0].prompt_token_ids == whole[10].prompt_token_ids  # all of gen:chat fits
    assert window[0].arrival_s == 0.0 and window[1].arrival_s > 0.0


def test_offline_rows_pass_the_load_window_to_their_pacing() -> None:
    """The parent's settings reach the engine process's pacing (``offline.choose_time_scale``
    reads the row spec that ``replay._row_spec`` writes)."""
    from argparse import Namespace

    from vllm_hybrid.bench.offline import choose_time_scale
    from vllm_hybrid.bench.replay import _row_spec

    at = [0.0, 4.0, 8.0, 9.0, 10.0, 14.0]
    reqs = build_workload(
        iter([_req([(i, 10)], 1000.0 * t) for i, t in enumerate(at)]), 6, 1.0, 4096
    )
    args = Namespace(model="m", dtype="float32", max_len=4096, max_num_seqs=4, blocks=None)
    args.host_gb, args.warmup, args.load = 0.0, 0, 0.5
    for window, expected in ((0, 5 / 14), (2, 1.0)):
        args.load_window = window
        spec = _row_spec(args, "ours", reqs, None)
        # one uncached request takes 0.5 s: the pace is 2/s, load 0.5 -> 1 arrival/s
        assert choose_time_scale(spec, 0.5) == pytest.approx(expected)
