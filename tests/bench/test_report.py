"""Summary numbers, the table, the ratio and oracle lines, the policy mapping. No engine."""

from __future__ import annotations

import json

import pytest

from vllm_hybrid.bench import BenchError
from vllm_hybrid.bench.policies import engine_setup, parse_policies
from vllm_hybrid.bench.report import (
    RequestRecord,
    RowResult,
    evictions_line,
    format_table,
    oracle_line,
    outputs_identical,
    percentile,
    ratio_line,
    sim_line,
    summarize,
    write_json,
)


def _row(policy: str, cached: list[int], ttft: list[float], outs: list[list[int]]) -> RowResult:
    recs = [
        RequestRecord(i, 0.1 * i, 100, c, len(o), t, t + 0.5, o)
        for i, (c, t, o) in enumerate(zip(cached, ttft, outs, strict=True))
    ]
    return RowResult(policy, 64, 2.0, 0.5, recs)


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 95) == pytest.approx(4.8)
    assert percentile([7.0], 95) == 7.0


def test_summarize_counts_what_the_engine_served() -> None:
    s = summarize(_row("stock", [0, 50, 100], [0.1, 0.2, 0.3], [[1, 2], [3], [4, 5, 6]]))
    assert s["prompt_tokens"] == 300 and s["cached_tokens"] == 150
    assert s["token_hit_rate"] == pytest.approx(0.5)
    assert s["prefill_tokens_computed"] == 150
    assert s["ttft_p50_ms"] == pytest.approx(200.0)
    assert s["throughput_tok_s"] == pytest.approx((300 + 6) / 2.0)
    assert s["requests_per_s"] == pytest.approx(1.5)


def test_oracle_and_lines() -> None:
    a = _row("stock", [0, 50], [0.2, 0.4], [[1], [2]])
    b = _row("ours", [0, 50], [0.1, 0.2], [[1], [2]])
    c = _row("off", [0, 0], [0.3, 0.5], [[1], [9]])
    assert outputs_identical([a, b])["identical"] is True
    bad = outputs_identical([a, b, c])
    assert bad["identical"] is False and bad["differing"] == [1]
    assert outputs_identical([a])["identical"] is None
    assert "NO (1 of 2 differ)" in oracle_line(bad)
    summaries = [summarize(r) for r in (a, b, c)]
    assert ratio_line(summaries) == "ours/stock: TTFT p50 0.50x, prefill tokens computed 1.00x"
    assert ratio_line(summaries[:1]) == ""
    table = format_table(summaries).splitlines()
    assert len(table) == 4 and table[0].split()[:3] == ["policy", "blocks", "requests"]
    assert table[3].split()[:4] == ["off", "64", "2", "0.000"]


def test_json_has_summary_and_every_record(tmp_path) -> None:
    rows = [_row("stock", [0, 50], [0.2, 0.4], [[1], [2]])]
    path = tmp_path / "out.json"
    write_json(path, {"trace": "x"}, rows, [summarize(rows[0])], outputs_identical(rows))
    obj = json.loads(path.read_text())
    assert obj["summary"][0]["policy"] == "stock"
    assert obj["rows"][0]["records"][1]["cached_tokens"] == 50
    assert RowResult.from_json(obj["rows"][0]) == rows[0]


def test_policies_map_to_engine_settings() -> None:
    assert parse_policies("stock, ours,off,marconi") == ["stock", "ours", "off", "marconi"]
    stock, off, ours = engine_setup("stock"), engine_setup("off"), engine_setup("ours")
    assert stock.engine_kwargs == {
        "enable_prefix_caching": True,
        "additional_config": {"vllm_hybrid": {"policy": "stock"}},
    }
    assert off.engine_kwargs["enable_prefix_caching"] is False
    assert ours.engine_kwargs["additional_config"] == {"vllm_hybrid": {"policy": "flop"}}
    sglang = engine_setup("sglang").engine_kwargs
    assert sglang["additional_config"] == {"vllm_hybrid": {"policy": "sglang"}}
    with pytest.raises(BenchError, match="unknown policy 'lru'"):
        parse_policies("stock,lru")
    with pytest.raises(BenchError, match="twice"):
        parse_policies("stock,stock")


def test_ours_is_the_default_policy() -> None:
    from vllm_hybrid.bench.policies import OURS_DEFAULT
    from vllm_hybrid.core.config import HybridCacheConfig

    assert OURS_DEFAULT == HybridCacheConfig.from_sources(None, {}).policy


def test_evictions_line_only_for_rows_that_report_them() -> None:
    a = _row("stock", [0], [0.1], [[1]])
    b = _row("ours", [0], [0.1], [[1]])
    b.evictions = {"policy_pages": 12, "fallback_pages": 3}
    line = evictions_line([summarize(a), summarize(b)])
    assert line == "blocks evicted by policy/LRU fallback: ours 12/3"
    assert evictions_line([summarize(a)]) == ""


def test_sim_line_says_how_many_requests_were_in_flight(tmp_path) -> None:
    a = _row("stock", [0, 50], [0.2, 0.4], [[1], [2]])
    b = _row("ours", [0, 50], [0.1, 0.2], [[1], [2]])
    assert sim_line([summarize(a), summarize(b)]) == ""  # no predictions
    a.sim_hit_rate, a.sim_in_flight, a.sim_hit_rate_1 = 0.16, 16, 0.163
    b.sim_hit_rate, b.sim_in_flight, b.sim_hit_rate_1 = 0.15, 15, 0.215
    line = sim_line([summarize(a), summarize(b)])
    assert line == (
        "sim hit simulated with: stock 16 in flight (one at a time 0.163), "
        "ours 15 in flight (one at a time 0.215)"
    )
    path = tmp_path / "out.json"
    write_json(path, {}, [b], [summarize(b)], outputs_identical([b]))
    obj = json.loads(path.read_text())
    assert obj["summary"][0]["sim_in_flight"] == 15
    assert RowResult.from_json(obj["rows"][0]) == b
