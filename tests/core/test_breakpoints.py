"""Cache options, pins and reports: parsing, validation, limits, reasons (the cache_control
marks of chat and Anthropic bodies: tests/serving/test_messages.py)."""

from __future__ import annotations

import pytest

from vllm_hybrid.core.breakpoints import (
    MAX_BREAKPOINTS,
    NO_OPTIONS,
    CacheOptionError,
    CacheOptions,
    common_prefix_tokens,
    effective_breakpoints,
    hit_position,
    merge_breakpoints,
)
from vllm_hybrid.core.cache_report import ReuseHistory
from vllm_hybrid.core.pins import PinLedger, PrewarmRequest

EPHEMERAL = {"type": "ephemeral"}


def test_options_forms() -> None:
    assert CacheOptions.from_extra_args(None) is NO_OPTIONS
    assert CacheOptions.from_extra_args({"other_extension": 1}) is NO_OPTIONS
    got = CacheOptions.from_extra_args({"cache_breakpoints": 600})
    assert got.breakpoints == (600,) and got.any and not got.report
    got = CacheOptions.from_extra_args(
        {"cache_breakpoints": [900, 300, 300.0], "cache_report": 1, "cache_pin_ttl_s": 5}
    )
    assert (got.breakpoints, got.report, got.pin_ttl_s) == ((300, 900), True, 5.0)
    assert CacheOptions.from_extra_args({"cache_report": "false"}).report is False


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"cache_breakpoints": "end"}, "'end' is not a token position"),
        ({"cache_breakpoints": [1, "2"]}, "'2' is not a token position"),
        ({"cache_breakpoints": True}, "True is not a token position"),
        ({"cache_breakpoints": 1.5}, "not a whole token position"),
        ({"cache_breakpoints": 0}, "must be at least 1"),
        ({"cache_breakpoints": list(range(1, MAX_BREAKPOINTS + 2))}, "at most 8 breakpoints"),
        ({"cache_breakpiont": 5}, r"unknown cache option\(s\) \['cache_breakpiont'\]"),
        ({"cache_report": "maybe"}, "cache_report: 'maybe' must be true or false"),
        ({"cache_report": 2}, "must be true or false"),
        ({"cache_pin_ttl_s": "long"}, "must be a number of seconds"),
        ({"cache_pin_ttl_s": 0}, "must be a positive number"),
        ({"cache_pin_ttl_s": float("inf")}, "must be a positive number"),
    ],
)
def test_bad_options_say_what_is_wrong(extra: dict, message: str) -> None:
    with pytest.raises(CacheOptionError, match=message):
        CacheOptions.from_extra_args(extra)


def test_positions_engines_act_on() -> None:
    # Clamped below the last prompt token: no hit reaches it, decoding mutates the state after it.
    assert effective_breakpoints((300, 900, 5000), 900) == (300, 899)
    assert effective_breakpoints((5,), 1) == ()
    assert [hit_position(p, 128) for p in (127, 128, 600, 899)] == [0, 128, 512, 896]


def test_merge_breakpoints_keeps_other_args() -> None:
    merged = merge_breakpoints({"cache_breakpoints": 50, "other": "x"}, [700, 50])
    assert merged == {"cache_breakpoints": [50, 700], "other": "x"}
    assert merge_breakpoints(None, []) == {}
    assert common_prefix_tokens([1, 2, 3], [1, 2, 4, 5]) == 2


def test_pin_ledger_bounds_ttl_and_expiry() -> None:
    ledger = PinLedger.for_pool(pool_pages=100, max_fraction=0.25, max_ttl_s=60)
    assert ledger.limit_pages == 25
    assert ledger.add("a", list(range(10)), 1280, ttl_s=10, now=0.0).ok
    assert ledger.add("b", list(range(10)), 1280, ttl_s=30, now=0.0).ok
    refused = ledger.add("c", list(range(6)), 640, ttl_s=10, now=0.0)
    assert not refused.ok and "20 of 25 pinnable pages are pinned already" in refused.message
    assert (
        not ledger.check("d", 1, ttl_s=61).ok
        and "max_pin_ttl_s" in ledger.check("d", 1, 61).message
    )
    assert "nothing to pin" in ledger.check("e", 0, ttl_s=1).message
    again = ledger.add("a", list(range(10)), 1280, ttl_s=20, now=5.0)
    assert again.ok and again.extended and ledger.pinned_pages == 20
    ledger.check_integrity()
    assert ledger.totals(now=5.0)["pin_ttl_left_seconds_max"] == 25
    assert [p.key for p in ledger.expire(now=24.0)] == []
    assert [p.key for p in ledger.expire(now=25.0)] == ["a"]
    assert ledger.pinned_pages == 10 and ledger.counters.expired == 1
    assert [p.key for p in ledger.release_all()] == ["b"] and ledger.pinned_pages == 0
    totals = ledger.totals(now=30.0)
    assert (totals["pins_taken"], totals["pins_refused"], totals["pins_extended"]) == (2, 1, 1)
    ledger.check_integrity()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "body must be a JSON object"),
        ({"ttl_s": 5}, 'exactly one of "prompt" and "messages"'),
        ({"prompt": "a", "messages": [{}]}, "exactly one of"),
        ({"prompt": ""}, "non-empty string or a non-empty list of token ids"),
        ({"prompt": [1, -2]}, "list of token ids"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"prompt": "a", "ttl_s": "soon"}, "ttl_s: 'soon' must be a number"),
        ({"prompt": "a", "model": 3}, "model must be a string"),
        ({"prompt": "a", "ttl": 3}, r"unknown field\(s\) \['ttl'\]"),
    ],
)
def test_prewarm_request_validation(body: object, message: str) -> None:
    with pytest.raises(CacheOptionError, match=message):
        PrewarmRequest.parse(body)


def test_prewarm_request_forms() -> None:
    got = PrewarmRequest.parse({"prompt": [1, 2, 3]})
    assert got.prompt == [1, 2, 3] and got.ttl_s == 300.0
    got = PrewarmRequest.parse(
        {"messages": [{"role": "system", "content": "s"}], "ttl_s": 9, "tools": []}
    )
    assert got.messages and got.ttl_s == 9.0 and got.chat == {"tools": []}


def tokens(*runs: tuple[int, int]) -> list[int]:
    """Token ids: runs of (first id, length)."""
    return [t for start, n in runs for t in range(start, start + n)]


def test_report_reasons() -> None:
    b = 4
    history = ReuseHistory(block_tokens=b)
    assert history.explain(tokens((0, 10)), None, 0, 0)["reason"] == "new_prefix"
    history.record(tokens((0, 10)), None)
    # Same first 6 tokens, then different: the hit at 4 is all that block granularity allows.
    report = history.explain(tokens((0, 6), (100, 6)), None, 4, 4)
    assert (report["reason"], report["diverges_at_token"]) == ("prompt_differs", 6)
    assert report["ended_on_snapshot"] is True
    # Shares 8 tokens (two blocks) but the cache gave nothing and held no KV: evicted.
    assert history.explain(tokens((0, 9), (100, 3)), None, 0, 0)["reason"] == "evicted"
    # KV up to 8 but the state only at 4: no snapshot at the divergence point.
    report = history.explain(tokens((0, 9), (100, 3)), None, 4, 8)
    assert report["reason"] == "no_snapshot" and report["cached_kv_tokens"] == 8
    # Another tenant's salt: never shared.
    assert history.explain(tokens((0, 10)), "tenant-b", 0, 0)["reason"] == "different_cache_salt"
    # The whole prompt was hit up to its last block boundary.
    assert history.explain(tokens((0, 10)), None, 8, 8)["reason"] == "full_hit"


def test_report_history_is_bounded() -> None:
    history = ReuseHistory(block_tokens=2, max_blocks=3, max_prompts=1)
    history.record(tokens((0, 8)), None)
    history.explain(tokens((50, 4)), None, 0, 0)  # recording is lazy: the report catches up
    assert len(history._blocks) == 3 and len(history._prompts) == 1
    with pytest.raises(ValueError, match="block_tokens"):
        ReuseHistory(block_tokens=0)
    with pytest.raises(ValueError, match="max_pending"):
        ReuseHistory(block_tokens=2, max_pending=0)


def test_report_history_records_lazily_and_forgets_the_oldest_pending() -> None:
    history = ReuseHistory(block_tokens=4, max_pending=2)
    history.record(tokens((0, 8)), None)
    assert not history._blocks  # nothing hashed until a report asks
    history.record(tokens((100, 8)), None)
    history.record(tokens((200, 8)), None)  # the first prompt falls out of the queue
    assert history.explain(tokens((0, 8), (300, 4)), None, 0, 0)["reason"] == "new_prefix"
    assert history.explain(tokens((200, 8), (300, 4)), None, 0, 0)["reason"] == "evicted"


def test_pin_settings() -> None:
    from vllm_hybrid.core.config import ConfigError, HybridCacheConfig

    default = HybridCacheConfig.from_sources(None, {})
    assert (default.max_pinned_fraction, default.max_pin_ttl_s) == (0.25, 3600.0)
    got = HybridCacheConfig.from_sources(
        {"max_pinned_fraction": "0.5"}, {"VLLM_HYBRID_MAX_PIN_TTL_S": "60"}
    )
    assert (got.max_pinned_fraction, got.max_pin_ttl_s) == (0.5, 60.0)
    for bad in (1.5, -0.1, "half", True):
        with pytest.raises(
            ConfigError, match=r"max_pinned_fraction .* must be a number in \[0, 1\]"
        ):
            HybridCacheConfig.from_sources({"max_pinned_fraction": bad}, {})
    with pytest.raises(ConfigError, match="max_pin_ttl_s -1 must be a number at least 0"):
        HybridCacheConfig.from_sources({"max_pin_ttl_s": -1}, {})
