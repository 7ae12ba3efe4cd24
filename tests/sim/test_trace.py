"""Mooncake reader, block-key expansion, generators and the simulate CLI."""

import json

import pytest

from vllm_hybrid.sim.cli import main
from vllm_hybrid.sim.generators import GENERATORS
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest, TraceError, load_mooncake

GOOD = {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [1, 2, 3]}


def _write(tmp_path, lines):
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_reads_and_expands_mooncake(tmp_path) -> None:
    other = dict(GOOD, hash_ids=[1, 2, 9], input_length=1500)
    reqs = load_mooncake(_write(tmp_path, [json.dumps(GOOD), "", json.dumps(other)]))
    assert len(reqs) == 2
    assert reqs[0].segments == ((1, 512), (2, 512), (3, 76)) and reqs[0].prompt_tokens == 1100
    assert not reqs[0].exact_end and reqs[0].cacheable_tokens == 1100
    a, b = (KeyedRequest(r, 64) for r in reqs)
    assert len(a.keys) == 1100 // 64 and len(b.keys) == 1500 // 64
    assert a.keys[:16] == b.keys[:16]  # the two shared 512-token blocks
    assert a.keys[16] != b.keys[16]  # ids 3 and 9 differ
    assert KeyedRequest(reqs[0], 64).keys == a.keys  # deterministic


@pytest.mark.parametrize(
    ("line", "reason"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object"),
        (
            json.dumps({k: v for k, v in GOOD.items() if k != "hash_ids"}),
            "missing field 'hash_ids'",
        ),
        (json.dumps(dict(GOOD, input_length=-3)), "input_length must be an integer >= 0"),
        (json.dumps(dict(GOOD, hash_ids=[1, "x", 3])), "hash_ids must be a list of integers"),
        (json.dumps(dict(GOOD, hash_ids=[1, 2])), "2 hash_ids for input_length 1100"),
        (json.dumps(dict(GOOD, timestamp="noon")), "timestamp must be a number"),
    ],
)
def test_malformed_lines_name_line_and_reason(tmp_path, line, reason) -> None:
    path = _write(tmp_path, [json.dumps(GOOD), line])
    with pytest.raises(TraceError, match=rf"t\.jsonl:2: .*{reason[:20]}"):
        load_mooncake(path)


def test_missing_trace_file(tmp_path) -> None:
    with pytest.raises(TraceError, match="not found"):
        load_mooncake(tmp_path / "none.jsonl")


def test_shared_prefix_keys_match_across_block_sizes() -> None:
    a = SimRequest(0.0, ((7, 100), (8, 30)), 130, 0)
    b = SimRequest(0.0, ((7, 100), (9, 30)), 130, 0)
    for block in (16, 50, 64):
        ka, kb = KeyedRequest(a, block), KeyedRequest(b, block)
        shared = 100 // block
        assert ka.keys[:shared] == kb.keys[:shared]
        assert ka.keys[shared:] != kb.keys[shared:] or not ka.keys[shared:]
    ka = KeyedRequest(a, 64)
    assert ka.key_at(128) == ka.keys[1] and ka.key_at(130) == ka.tail_key
    assert ka.probe(2, 2) == ka.tail_key


@pytest.mark.parametrize("name", sorted(set(GENERATORS) - {"prefix"}))
def test_generators_are_seeded_and_extend_sessions(name) -> None:
    one, two = GENERATORS[name](seed=3), GENERATORS[name](seed=3)
    assert one == two and one != GENERATORS[name](seed=4)
    assert all(x.arrival_ms <= y.arrival_ms for x, y in zip(one, one[1:], strict=False))
    # some request's content starts with an earlier request's whole content (a later turn)
    firsts = {r.segments for r in one}
    assert any(r.segments[:-2] in firsts for r in one)


def test_prefix_generator_is_vllms_prefix_repetition() -> None:
    reqs = GENERATORS["prefix"](seed=3)
    assert reqs == GENERATORS["prefix"](seed=3) != GENERATORS["prefix"](seed=4)
    assert len(reqs) == 128 and all(r.prompt_tokens == 1152 for r in reqs)
    assert all(x.arrival_ms <= y.arrival_ms for x, y in zip(reqs, reqs[1:], strict=False))
    by_prefix: dict[tuple[int, int], set] = {}
    for r in reqs:
        assert r.output_tokens == 16 and not r.exact_end
        by_prefix.setdefault(r.segments[0], set()).add(r.segments[1])
    # 16 prefixes of 1,024 tokens, 8 distinct suffixes each, shuffled (not grouped)
    assert len(by_prefix) == 16 and all(len(s) == 8 for s in by_prefix.values())
    assert [r.segments[0] for r in reqs[:8]] != [reqs[0].segments[0]] * 8


def test_cli_runs_and_writes_json(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    rc = main(
        [
            "simulate",
            "--trace",
            "gen:chat",
            "--limit",
            "120",
            "--model",
            "marconi-7b",
            "--budget-gb",
            "2,8",
            "--policies",
            "vllm,flop",
            "--json",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "belady" in text and "infinite" in text and "flop" in text
    data = json.loads(out.read_text())
    for row in data["budgets"].values():
        for stats in row["rows"].values():
            assert stats["peak_bytes"] <= stats["budget_bytes"]


@pytest.mark.parametrize(
    ("args", "msg"),
    [
        (["--policies", "lru,flop"], "unknown policy 'lru'"),
        (["--model", "gpt-9"], "unknown model shape 'gpt-9'"),
        (["--trace", "gen:nope"], "unknown generator 'nope'"),
        (["--budget-gb", "1,x"], "--budget-gb must be comma-separated numbers"),
        (["--host-gb", "-1"], "--host-gb must be >= 0"),
        (["--host-gbps", "0"], "--host-gbps must be > 0"),
        (["--sglang-pools", "-1"], "--sglang-pools must be >= 0"),
    ],
)
def test_cli_clear_errors(args, msg, capsys) -> None:
    base = ["simulate", "--trace", "gen:chat", "--limit", "5", "--no-progress"]
    assert main(base + args) == 2
    assert msg in capsys.readouterr().err


def test_cli_host_tier_and_int8_columns(tmp_path, capsys) -> None:
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", "gen:chat", "--limit", "300", "--model", "marconi-7b"]
    args += ["--budget-gb", "1", "--policies", "flop", "--no-progress", "--json", str(out)]
    assert main([*args, "--host-gb", "8", "--int8-snapshots"]) == 0
    text = capsys.readouterr().out
    assert "host tier 8 GB" in text and "host hits/demoted" in text
    flop = json.loads(out.read_text())["budgets"]["1000000000"]["rows"]["flop"]
    assert flop["host_budget_bytes"] == 8 * 10**9 and flop["demoted"] > 0
    assert flop["host_peak_bytes"] <= flop["host_budget_bytes"]


def test_cli_sglang_with_its_two_pools(tmp_path, capsys) -> None:
    """``--sglang-pools 0.9``: a ``sglang-2pool`` row, run with SGLang's split of the budget
    (9/19 for states; the pool raises if either part overflows): other hits than merged."""
    out = tmp_path / "r.json"
    args = ["simulate", "--trace", "gen:chat", "--limit", "200", "--model", "marconi-7b"]
    args += ["--budget-gb", "1", "--policies", "sglang", "--no-progress", "--json", str(out)]
    assert main([*args, "--sglang-pools", "0.9"]) == 0
    assert "sglang-2pool" in capsys.readouterr().out
    rows = json.loads(out.read_text())["budgets"]["1000000000"]["rows"]
    merged, split = rows["sglang"], rows["sglang-2pool"]
    assert split["budget_bytes"] == merged["budget_bytes"] == 10**9
    assert split["peak_bytes"] <= 10**9 and split["evicted_snapshots"] > 0
    assert split["token_hit_rate"] != merged["token_hit_rate"]
