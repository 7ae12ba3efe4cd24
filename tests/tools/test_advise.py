"""`vllm-hybrid advise` finds the planted reuse breakers and quantifies them."""

from __future__ import annotations

import json

import pytest

from vllm_hybrid import advise
from vllm_hybrid.cli import main


def test_finds_every_planted_breaker_kind(tmp_path):
    lines, planted = advise.generate_log(n_requests=80, seed=3)
    prompts = [advise.parse_line(raw, i) for i, raw in enumerate(lines, start=1)]
    breakers, total, reusable = advise.find_breakers(prompts)
    found = advise.summarize(breakers)
    for kind, count in planted.items():
        assert kind in found and found[kind]["count"] >= count
        assert found[kind]["saved_tokens"] > 100 * count  # each fix saves the system prompt
    assert "varying text" not in found
    assert reusable < total
    # every reported saving is real: those tokens agree in both prompts after the span
    for b in breakers:
        assert b.saved_tokens >= advise.MIN_RUN_TOKENS


def test_clean_log_has_no_breakers():
    system = "Answer briefly. " * 40
    prompts = [
        advise.Prompt(i, system + f"question {i} about caching", canonical_text="")
        for i in range(10)
    ]
    breakers, total, reusable = advise.find_breakers(prompts)
    assert breakers == [] and reusable > 0.8 * total


def test_timestamp_breaker_position_and_saving():
    stable = " ".join(f"rule{i}" for i in range(60))
    a = advise.Prompt(1, f"Now: 2026-01-01 10:00:00. {stable} q1")
    b = advise.Prompt(2, f"Now: 2026-01-02 11:30:15. {stable} q2")
    (brk,), _, _ = advise.find_breakers([a, b])
    assert brk.kind == "timestamp" and brk.line == 2 and brk.other_line == 1
    # the break is inside the date; the whole stable part (119 tokens + spaces) is recoverable
    assert brk.position_tokens < 10 and brk.saved_tokens >= 119


@pytest.mark.parametrize(
    "raw, match",
    [
        ("{not json", "line 1: not JSON"),
        ("[1, 2]", "line 1: expected an object"),
        ('{"messages": "hi"}', "line 1: needs a string 'prompt'"),
        ('{"messages": [], "tools": [{"function": {}}]}', "line 1: every tool needs a name"),
    ],
)
def test_malformed_lines_are_clear_errors(raw, match):
    with pytest.raises(advise.LogError, match=match):
        advise.parse_line(raw, 1)


def test_cli_generate_and_advise(tmp_path, capsys):
    log, out = tmp_path / "log.jsonl", tmp_path / "breakers.json"
    assert main(["advise", "--generate", str(log)]) == 0
    assert main(["advise", str(log), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "timestamp" in text and "reordered tools" in text and "fixing all" in text
    assert json.loads(out.read_text())
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\ngarbage\n')
    assert main(["advise", str(bad)]) == 2
    assert "line 2: not JSON" in capsys.readouterr().err
