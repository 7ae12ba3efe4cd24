"""``bench replay --replicas N``: the flags it refuses before any Ray or engine starts, and the
cluster simulation that predicts each live router row (no Ray here: the live run is in
``tests/cluster/test_bench_cluster.py``, slow)."""

from __future__ import annotations

import pytest

from vllm_hybrid.bench.cluster import add_cluster_predictions, engine_flags, replicas_line
from vllm_hybrid.bench.predict import PoolLayout
from vllm_hybrid.bench.report import RequestRecord, RowResult
from vllm_hybrid.bench.workload import BenchRequest
from vllm_hybrid.cli import main

B = 16
LAYOUT = PoolLayout(
    blocks=256, block_tokens=B, page_bytes=4096, kv_groups=1, state_groups=3, model_type="zamba2"
)


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["bench", "replay", "--trace", "gen:chat", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("vllm-hybrid bench replay: ") and message in err, err


def test_cluster_flags_are_checked_before_anything_starts(capsys, tmp_path) -> None:
    model = ["--model", str(tmp_path), "--requests", "3"]
    _fails(capsys, [*model, "--router", "state"], "--router needs --replicas N")
    _fails(capsys, [*model, "--replicas", "0"], "--replicas must be >= 1, got 0")
    _fails(capsys, [*model, "--replicas", "2", "--url", "http://x"], "does not go with --url")
    _fails(capsys, [*model, "--replicas", "2", "--host-gb", "1"], "--host-gb is not available")
    _fails(capsys, [*model, "--replicas", "2", "--router-tflops", "0"], "--router-tflops must be")
    pytest.importorskip("ray", reason="the router names are checked after Ray is found")
    _fails(capsys, [*model, "--replicas", "2", "--router", "state,best"], "unknown router 'best'")


def test_engine_flags_carry_the_pool_and_limits() -> None:
    import argparse

    args = argparse.Namespace(dtype="float32", max_len=2048, max_num_seqs=8, blocks=96)
    flags = engine_flags(args)
    assert flags[flags.index("--num-gpu-blocks-override") + 1] == "96"
    assert flags[flags.index("--max-model-len") + 1] == "2048"
    args.blocks = None
    assert "--num-gpu-blocks-override" not in engine_flags(args)


def _row(router: str, reqs: list[BenchRequest]) -> RowResult:
    records = [
        RequestRecord(r.index, r.arrival_s, r.prompt_tokens, 0, r.max_tokens, 0.1, 0.2, [])
        for r in reqs
    ]
    row = RowResult(router, LAYOUT.blocks, 1.0, 1.0, records, layout=LAYOUT.to_json())
    row.cluster = {"router": router, "replicas": 2, "per_replica": [len(reqs)]}
    return row


def test_the_cluster_simulation_predicts_each_router_row() -> None:
    # two system prompts of 4 blocks, 6 questions each: a router that keeps a prompt's
    # requests together hits more than one that alternates (arrivals far apart: no queues)
    systems = [list(range(1000 + 100 * k, 1000 + 100 * k + 4 * B)) for k in range(2)]
    reqs = [
        BenchRequest(i, 100.0 * i, tuple(systems[(i // 2) % 2] + [5000 + i] * (B + 3)), 4)
        for i in range(12)
    ]
    rows = [_row("state", reqs), _row("round-robin", reqs)]
    add_cluster_predictions(rows, reqs, 2, 0.05)
    state, rr = rows
    for row in rows:
        assert 0.0 < row.sim_hit_rate < 1.0
        assert sum(row.cluster["sim_per_replica"]) == len(reqs)
    assert state.sim_hit_rate > rr.sim_hit_rate
    assert state.cluster["sim_decisions"]["score"] > 0
    line = replicas_line(rows)
    assert line.startswith("requests per replica, live / sim: state [12] / [")


def test_rows_without_a_layout_get_no_prediction() -> None:
    reqs = [BenchRequest(0, 0.0, tuple(range(100, 140)), 2)]
    row = _row("state", reqs)
    row.layout = None
    add_cluster_predictions([row], reqs, 2, 0.05)
    assert row.sim_hit_rate is None
