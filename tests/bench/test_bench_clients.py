"""``benchmarks/bench_clients.py``'s pure parts: arguments, command lines, the clients' result
files, /metrics deltas, the output oracle, the table. No server, no client is started."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_clients  # noqa: E402
import clients_report as cr  # noqa: E402

# --- arguments -------------------------------------------------------------------------------


def test_pools_accept_the_aliases_and_blocks_at_rate() -> None:
    assert cr.parse_pool("tight") == ("96@0.5", 96, 0.5)
    assert cr.parse_pool("moderate") == ("300@0.3", 300, 0.3)
    assert cr.parse_pool(" 128@2 ") == ("128@2", 128, 2.0)


@pytest.mark.parametrize("spec", ["", "96", "96@", "@0.5", "x@1", "0@0.5", "96@0", "96@-1"])
def test_a_bad_pool_names_the_form(spec: str) -> None:
    with pytest.raises(cr.UsageError, match="BLOCKS@RATE|positive"):
        cr.parse_pool(spec)


def test_choices_keep_order_drop_repeats_and_name_the_valid_ones() -> None:
    assert cr.parse_choices("all", cr.CONFIGS, "configuration") == list(cr.CONFIGS)
    assert cr.parse_choices("off, stock,off", cr.CONFIGS, "configuration") == ["off", "stock"]
    with pytest.raises(cr.UsageError, match="unknown configuration flop; choose from stock"):
        cr.parse_choices("ours,flop", cr.CONFIGS, "configuration")
    with pytest.raises(cr.UsageError, match="no client given"):
        cr.parse_choices(" , ", cr.CLIENTS, "client")


@pytest.fixture
def fake_clients(tmp_path: Path) -> Path:
    """A clients venv with both tools present (empty files: never run)."""
    for tool in ("guidellm", "aiperf"):
        path = tmp_path / "venv" / tool / "bin" / tool
        path.parent.mkdir(parents=True)
        path.write_text("")
    return tmp_path / "venv"


def test_arguments_resolve_defaults(tmp_path: Path, fake_clients: Path) -> None:
    args = bench_clients.parse_args(
        ["--out", str(tmp_path / "o"), "--clients-venv", str(fake_clients)]
    )
    assert args.config_list == ["stock", "ours", "off"]
    assert args.client_list == list(cr.CLIENTS)
    assert [p[0] for p in args.pool_list] == ["96@0.5", "300@0.3"]
    assert args.json == str(tmp_path / "o" / "results.json")
    assert args.png == str(tmp_path / "o" / "results.png")


def test_a_model_not_built_yet_is_made_absolute(
    tmp_path: Path, fake_clients: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the server runs in --code's directory: a relative path would not exist there
    monkeypatch.chdir(tmp_path)
    args = bench_clients.parse_args(
        ["--model", "models/new", "--out", "o", "--clients-venv", str(fake_clients)]
    )
    assert args.model == str(tmp_path / "models" / "new")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--configs", "lru"], "unknown configuration lru"),
        (["--clients", "sglang-bench"], "unknown client sglang-bench"),
        (["--pools", "96x0.5"], "bad pool"),
        (["--pools", ","], "no pool given"),
        (["--num-prompts", "8"], "at least 16"),
        (["--turns", "0"], "--turns must be positive"),
        (["--code", "/nonexistent"], "no vllm_hybrid/ there"),
    ],
)
def test_bad_arguments_are_usage_errors(argv: list[str], message: str, fake_clients: Path) -> None:
    with pytest.raises(cr.UsageError, match=message):
        bench_clients.parse_args([*argv, "--clients-venv", str(fake_clients)])


def test_a_missing_client_tool_says_how_to_install_it(tmp_path: Path) -> None:
    with pytest.raises(cr.UsageError, match="install_clients.sh"):
        bench_clients.parse_args(["--clients", "aiperf", "--clients-venv", str(tmp_path)])
    # vLLM's own client needs nothing from the clients venv
    bench_clients.parse_args(["--clients", "vllm-prefix", "--clients-venv", str(tmp_path)])


def test_main_prints_one_line_and_exits_2(capsys: pytest.CaptureFixture[str], tmp_path) -> None:
    assert bench_clients.main(["--report-only", "--json", str(tmp_path / "none.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"bench_clients.py: error: --report-only: {tmp_path / 'none.json'} does not exist"
    ]


# --- command lines ---------------------------------------------------------------------------


def test_server_commands_differ_only_in_the_cache_flags() -> None:
    def cmd(config: str) -> list[str]:
        return bench_clients.server_command("py", "/m", 8000, config, 96, 4096)

    common = cmd("off")[:-1]
    assert cmd("off")[-1] == "--no-enable-prefix-caching"
    assert cmd("ours") == [*common, "--enable-prefix-caching"]
    assert cmd("stock") == [
        *common, "--enable-prefix-caching",
        "--additional-config", '{"vllm_hybrid": {"policy": "stock"}}',
    ]  # fmt: skip
    for flag in ("--dtype", "--enforce-eager", "--enable-prompt-tokens-details"):
        assert flag in common
    assert common[common.index("--num-gpu-blocks-override") + 1] == "96"
    # ours is the defaults: no additional config, no match unit of our own
    assert not {"--additional-config", "--prefix-match-unit"} & set(cmd("ours"))
    with pytest.raises(cr.UsageError):
        cmd("flop")


def test_client_commands_carry_the_workload(tmp_path: Path, fake_clients: Path) -> None:
    args = bench_clients.parse_args(
        ["--clients-venv", str(fake_clients), "--conv-requests", "64", "--turns", "4"]
    )

    def value(cmd: list[str], flag: str) -> str:
        return cmd[cmd.index(flag) + 1]

    pr = bench_clients.client_command("vllm-prefix", args, "http://h:1", 0.3, tmp_path)
    assert value(pr, "--dataset-name") == "prefix_repetition"
    assert value(pr, "--prefix-repetition-num-prefixes") == "16"
    assert value(pr, "--prefix-repetition-prefix-len") == "1024"
    assert value(pr, "--request-rate") == "0.3"
    assert value(pr, "--seed") == "7" and value(pr, "--temperature") == "0"
    assert "--save-detailed" in pr
    rnd = bench_clients.client_command("vllm-random", args, "http://h:1", 0.5, tmp_path)
    assert value(rnd, "--random-prefix-len") == "1024"
    ai = bench_clients.client_command("aiperf", args, "http://h:1", 0.5, tmp_path)
    assert value(ai, "--conversation-num") == "16"
    assert value(ai, "--arrival-pattern") == "poisson"
    assert json.loads(value(ai, "--extra-inputs")) == {"temperature": 0, "ignore_eos": True}
    scenario = bench_clients.guidellm_scenario(args, "http://h:1", 0.5, tmp_path)["spec"]
    assert scenario["profile"] == {"kind": "poisson", "rate": [0.5]}
    assert scenario["data"][0]["turns"] == 4 and scenario["data"][0]["prefix_tokens"] == 1024
    assert scenario["constraints"] == [{"kind": "max_requests", "count": 64}]


# --- /metrics --------------------------------------------------------------------------------

METRICS_BEFORE = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="bench"} 100.0
vllm:prefix_cache_queries_created{engine="0",model_name="bench"} 1.7e+09
vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 10.0
vllm:num_preemptions_total{engine="0",model_name="bench"} 1.0
vllm:num_preemptions_total{engine="1",model_name="bench"} 2.0
"""
METRICS_AFTER = """\
vllm:prefix_cache_queries_total{engine="0",model_name="bench"} 1100.0
vllm:prefix_cache_hits_total{engine="0",model_name="bench"} 760.0
vllm:num_preemptions_total{engine="0",model_name="bench"} 4.0
vllm:num_preemptions_total{engine="1",model_name="bench"} 2.0
vllm_hybrid:policy_evicted_pages_total{engine="0",model_name="bench"} 7.0
garbage line
"""


def test_metrics_are_summed_over_labels_and_skip_created() -> None:
    parsed = cr.parse_metrics(METRICS_BEFORE)
    assert parsed == {
        "vllm:prefix_cache_queries_total": 100.0,
        "vllm:prefix_cache_hits_total": 10.0,
        "vllm:num_preemptions_total": 3.0,
    }


def test_delta_and_hit_rate() -> None:
    delta = cr.metrics_delta(cr.parse_metrics(METRICS_BEFORE), cr.parse_metrics(METRICS_AFTER))
    assert delta == {
        "vllm:prefix_cache_queries": 1000.0,
        "vllm:prefix_cache_hits": 750.0,
        "vllm:num_preemptions": 3.0,
        "vllm_hybrid:policy_evicted_pages": 7.0,
    }
    assert cr.server_hit_rate(delta) == 0.75
    assert cr.server_hit_rate({}) is None  # caching off: nothing queried


# --- the clients' files ----------------------------------------------------------------------


def test_vllm_bench_result() -> None:
    result = {
        "completed": 3, "failed": 0, "duration": 10.0, "mean_ttft_ms": 1500.0,
        "median_ttft_ms": 400.0, "p99_ttft_ms": 8000.0, "output_throughput": 4.8,
        "total_input_tokens": 3456, "generated_texts": ["a", "b", "c"],
    }  # fmt: skip
    row = cr.read_vllm_bench(result)
    assert row["ttft_mean_s"] == 1.5 and row["ttft_p50_s"] == 0.4 and row["ttft_p99_s"] == 8.0
    assert row["requests"] == 3 and row["out_tok_s"] == 4.8 and row["hit_client"] is None
    assert row["outputs"] == {"0": "a", "1": "b", "2": "c"}
    del result["mean_ttft_ms"]
    with pytest.raises(ValueError, match="mean_ttft_ms"):
        cr.read_vllm_bench(result)


def _guidellm_request(text: str, prompt: int, cached: int, output: str) -> dict:
    user = {"role": "user", "content": [{"type": "text", "text": text}]}
    body = {"messages": [{"role": "system", "content": "S"}, user]}
    return {
        "request_args": json.dumps({"body": body}), "prompt_tokens": prompt,
        "cached_tokens": cached, "output_tokens": 16, "output": output,
    }  # fmt: skip


def test_guidellm_report() -> None:
    report = {
        "benchmarks": [{
            "duration": 8.0,
            "metrics": {"time_to_first_token_ms": {"successful": {
                "mean": 2000.0, "median": 1000.0, "percentiles": {"p99": 7000.0}}}},
            "requests": {
                "successful": [_guidellm_request("1 0 m0 hi", 1000, 0, "x"),
                               _guidellm_request("1 0 m1 ho", 1200, 900, "y")],
                "errored": [{}],
            },
        }]
    }  # fmt: skip
    row = cr.read_guidellm(report)
    assert (row["ttft_mean_s"], row["ttft_p50_s"], row["ttft_p99_s"]) == (2.0, 1.0, 7.0)
    assert row["requests"] == 2 and row["errors"] == 1
    assert row["out_tok_s"] == 32 / 8.0
    assert row["hit_client"] == 900 / 2200
    assert row["outputs"] == {"1 0 m0 hi": "x", "1 0 m1 ho": "y"}
    with pytest.raises(ValueError, match="guidellm"):
        cr.read_guidellm({"benchmarks": []})


def test_aiperf_summary_and_outputs() -> None:
    summary = {
        "time_to_first_token": {"unit": "ms", "avg": 1200.0, "p50": 700.0, "p99": 3600.0},
        "output_token_throughput": {"avg": 4.0}, "request_count": {"avg": 6.0},
        "benchmark_duration": {"avg": 20.0}, "total_usage_prompt_tokens": {"avg": 8000.0},
        "total_usage_prompt_cache_read_tokens": {"avg": 6000.0}, "error_summary": [],
    }  # fmt: skip
    outputs = {"data": [{"conversation_id": "s0", "turn_index": 1, "response_text": "z"}]}
    row = cr.read_aiperf(summary, outputs)
    assert (row["ttft_mean_s"], row["ttft_p50_s"], row["ttft_p99_s"]) == (1.2, 0.7, 3.6)
    assert row["requests"] == 6 and row["hit_client"] == 0.75 and row["out_tok_s"] == 4.0
    assert row["outputs"] == {"s0/1": "z"}
    del summary["total_usage_prompt_cache_read_tokens"]
    assert cr.read_aiperf(summary, None)["hit_client"] is None
    with pytest.raises(ValueError, match="aiperf"):
        cr.read_aiperf({}, None)


# --- rows, the oracle, the table -------------------------------------------------------------


def _row(config: str, ttft: float, outputs: dict, client: str = "vllm-prefix", **kw) -> dict:
    return {
        "client": client, "config": config, "pool": "96@0.5", "blocks": 96, "rate": 0.5,
        "requests": 128, "errors": 0, "ttft_mean_s": ttft, "ttft_p50_s": ttft / 2,
        "ttft_p99_s": ttft * 3, "out_tok_s": 10.0 / ttft, "hit_server": 0.7,
        "hit_client": None, "server": {"vllm:num_preemptions": 2.0}, "outputs": outputs, **kw,
    }  # fmt: skip


def test_merge_replaces_a_rerun_and_orders_rows() -> None:
    moderate = {**_row("ours", 1.0, {}), "pool": "300@0.3", "blocks": 300}
    old = [_row("off", 9.0, {}), _row("stock", 4.0, {}), moderate]
    new = [_row("stock", 3.0, {}), _row("ours", 2.0, {}, client="aiperf")]
    merged = cr.merge_rows(old, new)
    assert [(r["pool"], r["client"], r["config"]) for r in merged] == [
        ("300@0.3", "vllm-prefix", "ours"),
        ("96@0.5", "vllm-prefix", "stock"),
        ("96@0.5", "vllm-prefix", "off"),
        ("96@0.5", "aiperf", "ours"),
    ]
    assert merged[1]["ttft_mean_s"] == 3.0


def test_outputs_are_compared_over_common_requests() -> None:
    assert cr.compare_outputs({"0": "a", "1": "b", "2": "c"}, {"0": "a", "1": "B"}) == {
        "compared": 2, "differ": 1, "examples": ["1"],
    }  # fmt: skip


def test_table_prints_ratios_and_the_oracle() -> None:
    rows = [
        _row("stock", 4.0, {"0": "a", "1": "b"}),
        _row("ours", 1.0, {"0": "a", "1": "b"}, server={"vllm_hybrid:kv_pages_evicted": 5.0}),
        _row("off", 8.0, {"0": "a", "1": "x"}, hit_server=None),
    ]
    summary = cr.summarize(rows)
    assert summary[0]["ttft_mean_ratio"] == 0.25
    assert summary[0]["ours_vs_off"]["differ"] == 1
    table = cr.format_table(rows)
    lines = table.splitlines()
    assert lines[0] == cr.HEADER
    assert lines[2].split()[:4] == ["96@0.5", "vllm-prefix", "stock", "128"]
    assert lines[3].split()[4:] == ["1.00", "0.50", "3.00", "70.0%", "-", "10.00", "0", "5"]
    assert lines[4].split()[7] == "-"  # off: no hit rate
    assert "ours/stock TTFT mean 0.25x, p50 0.25x, out tok/s 4.00x" in table
    assert "ours == off: NO (1 differ) (2 requests)" in table
    assert "stock == off: NO (1 differ) (2 requests)" in table


def test_plot_writes_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    rows = [_row(c, t, {}) for c, t in (("stock", 4.0), ("ours", 1.0), ("off", 8.0))]
    cr.plot(rows, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
