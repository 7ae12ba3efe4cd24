"""Settings: mapping over environment over defaults; every bad value fails with its name."""

from __future__ import annotations

import pytest

from vllm_hybrid.core.config import ConfigError, HybridCacheConfig, periodic_interval


def test_defaults_and_precedence() -> None:
    assert HybridCacheConfig.from_sources(None, {}) == HybridCacheConfig()
    env = {"VLLM_HYBRID_POLICY": "vllm", "VLLM_HYBRID_DEBUG": "1"}
    env["VLLM_HYBRID_SNAPSHOT_EVERY"] = "0"
    got = HybridCacheConfig.from_sources(None, env)
    assert (got.policy, got.debug, got.snapshot_every) == ("vllm", True, 0)
    got = HybridCacheConfig.from_sources({"policy": "stock", "debug": False}, env)
    assert (got.policy, got.debug, got.enabled) == ("stock", False, False)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"policy": "lfu"}, "policy 'lfu' is not a policy; valid: stock, flop"),
        ({"polcy": "flop"}, r"unknown setting\(s\) \['polcy'\]"),
        ({"snapshot_every": -128}, "snapshot_every -128 must be one of auto, engine, dense"),
        ({"snapshot_every": "often"}, "snapshot_every 'often'"),
        ({"snapshot_every": True}, "snapshot_every True"),
        ({"debug": "maybe"}, "debug 'maybe' must be true or false"),
        ({"shape": " "}, "shape must not be empty"),
        ({"match_unit": 0}, "match_unit 0 must be one of auto, block or a positive token count"),
        ({"match_unit": "fine"}, "match_unit 'fine'"),
        ({"match_unit": True}, "match_unit True"),
        ({"system_breakpoint": "sometimes"}, "system_breakpoint 'sometimes' must be true or"),
        ({"exact_prompt_end": "maybe"}, "exact_prompt_end 'maybe' must be true or"),
    ],
)
def test_bad_values_name_the_setting(settings: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        HybridCacheConfig.from_sources(settings, {})


def test_bad_environment_is_refused_too() -> None:
    with pytest.raises(ConfigError, match="policy 'nope'"):
        HybridCacheConfig.from_sources({}, {"VLLM_HYBRID_POLICY": "nope"})


def test_periodic_interval() -> None:
    assert periodic_interval("dense", 1024, 128) == 128
    assert periodic_interval("auto", 1000, 128) == 1024
    assert periodic_interval("auto", 10, 128) == 128
    assert periodic_interval("auto", None, 128) == 0
    assert periodic_interval(0, 1024, 128) == 0
    assert periodic_interval(512, None, 128) == 512
    with pytest.raises(ConfigError, match="multiple of the block size"):
        periodic_interval(500, None, 128)


def test_snapshot_budget_share() -> None:
    default = HybridCacheConfig.from_sources(None, {})
    assert default.max_snapshot_fraction == 1.0 and default.snapshot_budget_pages(384) is None
    got = HybridCacheConfig.from_sources(None, {"VLLM_HYBRID_MAX_SNAPSHOT_FRACTION": "0.25"})
    assert got.snapshot_budget_pages(384) == 96
    assert got.snapshot_budget_warning(384, 6) == ""
    got = HybridCacheConfig.from_sources({"max_snapshot_fraction": 0.01}, {})
    assert got.snapshot_budget_pages(384) == 3  # under one snapshot of 6 pages
    assert "leaves 3 pages of 384, under one snapshot (6 pages)" in got.snapshot_budget_warning(
        384, 6
    )
    assert default.snapshot_budget_warning(384, 6) == ""
    for bad in ("-0.1", "1.5", "half", True, None):
        with pytest.raises(
            ConfigError, match=r"max_snapshot_fraction .* must be a number in \[0, 1\]"
        ):
            HybridCacheConfig.from_sources({"max_snapshot_fraction": bad}, {})


def test_the_engine_match_unit_is_ours_only_where_the_user_set_none() -> None:
    default = HybridCacheConfig.from_sources(None, {})
    assert (default.match_unit, default.system_breakpoint) == ("auto", True)
    assert default.exact_prompt_end is False
    on = HybridCacheConfig.from_sources({"exact_prompt_end": "true"}, {})
    assert on.exact_prompt_end is True
    assert HybridCacheConfig.from_sources(None, {"VLLM_HYBRID_EXACT_PROMPT_END": "1"}) == on
    assert default.engine_match_unit(None, hybrid_align=True) == 1  # exact resume
    assert default.engine_match_unit(16, hybrid_align=True) is None  # the user's wins
    assert default.engine_match_unit(None, hybrid_align=False) is None  # not a hybrid
    stock = HybridCacheConfig.from_sources({"policy": "stock"}, {})
    assert stock.engine_match_unit(None, hybrid_align=True) is None  # vLLM's, untouched
    block = HybridCacheConfig.from_sources({"match_unit": "block"}, {})
    assert block.engine_match_unit(None, hybrid_align=True) is None
    env = {"VLLM_HYBRID_MATCH_UNIT": "16", "VLLM_HYBRID_SYSTEM_BREAKPOINT": "0"}
    got = HybridCacheConfig.from_sources(None, env)
    assert (got.engine_match_unit(None, hybrid_align=True), got.system_breakpoint) == (16, False)
