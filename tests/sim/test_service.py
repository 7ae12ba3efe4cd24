"""The service-time model (sim/service.py) and the TTFT the single-engine replay derives from it."""

import pytest

from vllm_hybrid.core import POLICIES, CostModel, load_shape
from vllm_hybrid.sim.cli import main
from vllm_hybrid.sim.generators import gen_chat
from vllm_hybrid.sim.replay import replay
from vllm_hybrid.sim.service import PrefillQueue, quantile
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest

B = 128
COST = CostModel(load_shape("zamba2-7b"), B)


def test_fifo_queue_waits_for_the_prefill_ahead() -> None:
    q = PrefillQueue(100.0)
    assert q.serve(0.0, 200.0) == pytest.approx(2.0)  # alone: its own 2 s
    assert q.serve(1.0, 100.0) == pytest.approx(2.0)  # waits 1 s, then 1 s
    assert q.backlog_flops(2.5) == pytest.approx(50.0)  # 0.5 s of work left
    assert q.serve(10.0, 0.0, extra_s=0.25) == pytest.approx(0.25)  # idle: the transfer only
    assert q.busy_s == pytest.approx(3.25)
    with pytest.raises(ValueError, match="must be > 0"):
        PrefillQueue(0.0)


def test_quantile_is_nearest_rank() -> None:
    xs = [5.0, 1.0, 3.0, 2.0, 4.0]
    assert [quantile(xs, q) for q in (0.0, 0.2, 0.5, 0.95, 1.0)] == [1.0, 1.0, 3.0, 5.0, 5.0]
    assert quantile([], 0.5) == 0.0


def _requests() -> list[KeyedRequest]:
    """Two requests at once, the second extending the first, then a third, alone, 60 s later."""
    a = SimRequest(0.0, ((1, 8 * B),), 8 * B, 4)
    b = SimRequest(0.0, ((1, 8 * B), (3, 2 * B)), 10 * B, 4)
    c = SimRequest(60_000.0, ((4, 4 * B),), 4 * B, 4)
    return [KeyedRequest(r, B) for r in (a, b, c)]


@pytest.mark.parametrize("policy", ["flop", "vllm"])
def test_replay_ttft_is_the_unsaved_prefill_queued_at_arrival(policy: str) -> None:
    x = 1e12
    hits: list[int] = []
    stats = replay(
        _requests(), COST, POLICIES[policy](COST), int(1e12), throughput_flops=x, hits_out=hits
    )
    fa = COST.span_flops(0, 8 * B) / x
    fb = COST.span_flops(hits[1], 10 * B) / x
    fc = COST.span_flops(0, 4 * B) / x
    assert hits[0] == 0 and hits[1] > 0
    assert stats.ttft_s == pytest.approx([fa, fa + fb, fc])  # b waits for a, c for nobody
    d = stats.to_dict()
    assert "ttft_s" not in d
    assert d["ttft_p50_s"] == pytest.approx(fa) and d["ttft_p95_s"] == pytest.approx(fa + fb)
    assert d["ttft_mean_s"] == pytest.approx((2 * fa + fb + fc) / 3)


def test_a_hit_shortens_the_wait_of_everyone_behind_it() -> None:
    """Every request of a chat workload at once: caching lowers each request's TTFT."""
    reqs = [
        KeyedRequest(SimRequest(0.0, r.segments, r.prompt_tokens, r.output_tokens, r.exact_end), B)
        for r in gen_chat(n_sessions=12, seed=1)
    ]
    cached = replay(reqs, COST, POLICIES["flop"](COST), int(4e9))
    cold = replay(reqs, COST, POLICIES["vllm"](COST), COST.snapshot_bytes + B * 2)
    assert cached.hit_tokens > 0 and cold.hit_tokens == 0
    assert all(c <= u for c, u in zip(cached.ttft_s, cold.ttft_s, strict=True))
    assert cached.ttft(0.5) < cold.ttft(0.5)


def test_a_host_hit_waits_for_its_transfer() -> None:
    """Requests far apart (no queueing): each TTFT is its unsaved prefill plus its transfer
    from the host tier, so over the run the extra time is the tier's promotion time."""
    x, reqs, hits = 1e12, [], []
    for i, r in enumerate(gen_chat(seed=3)[:200]):
        spread = SimRequest(i * 1e6, r.segments, r.prompt_tokens, r.output_tokens, r.exact_end)
        reqs.append(KeyedRequest(spread, B))
    kw = {"host_bytes": int(8e9), "host_bandwidth": 1e8, "throughput_flops": x}
    stats = replay(reqs, COST, POLICIES["flop"](COST), int(2e9), hits_out=hits, **kw)
    assert stats.host_hits > 0
    prefill = [
        COST.span_flops(h, kr.req.prompt_tokens) / x for h, kr in zip(hits, reqs, strict=True)
    ]
    extra = [t - p for t, p in zip(stats.ttft_s, prefill, strict=True)]
    assert min(extra) > -1e-6 and sum(extra) == pytest.approx(stats.promote_seconds)
    assert sum(e > 1e-6 for e in extra) == stats.host_hits  # the rest: float rounding


def test_simulate_prints_ttft_columns(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", "gen:chat", "--limit", "40", "--budget-gb", "1"]
    argv += ["--policies", "flop,vllm", "--no-progress", "--throughput-tflops", "100"]
    assert main([*argv, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "TTFT p50/p95 s" in text and "prefill 100 TFLOP/s" in text
    import json

    row = json.loads(out.read_text())["budgets"]["1000000000"]["rows"]["flop"]
    assert row["throughput_flops"] == 1e14 and row["ttft_p95_s"] >= row["ttft_p50_s"] > 0
