"""``vllm-hybrid bench replay --replicas 2``: a live local cluster per router against the
cluster simulation (slow: two clusters). Oracles: greedy outputs are the same under both
routers; every row has a simulated hit rate and the live and simulated requests per replica
each add up to the workload."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("ray", reason="the cluster tests need the cluster extra")
pytest.importorskip("vllm", reason="the cluster tests need the cpu extra")

from vllm_hybrid.cli import main  # noqa: E402
from vllm_hybrid.testing.fixtures import model_cache_root, tiny_model_dir  # noqa: E402

pytestmark = [pytest.mark.cluster, pytest.mark.engine, pytest.mark.slow]


def test_bench_replay_replicas_rows_against_the_cluster_simulation(tmp_path_factory, capsys):
    model = tiny_model_dir("zamba2", model_cache_root(tmp_path_factory.mktemp("models")))
    out = tmp_path_factory.mktemp("bench") / "cluster.json"
    argv = ["bench", "replay", "--trace", "gen:chat", "--model", str(model), "--requests", "12"]
    argv += ["--replicas", "2", "--router", "state,round-robin", "--time-scale", "0"]
    argv += ["--max-tokens", "4", "--warmup", "0", "--json", str(out), "--no-progress"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "requests per replica, live / sim: state" in printed
    report = json.loads(out.read_text())
    assert report["outputs_identical"]["identical"] is True
    for row in report["rows"]:
        cluster = row["cluster"]
        assert row["sim_hit_rate"] is not None and row["layout"]["blocks"] > 0
        assert sum(cluster["per_replica"]) == 12 and sum(cluster["sim_per_replica"]) == 12
    state = next(s for s in report["summary"] if s["policy"] == "state")
    assert state["token_hit_rate"] > 0
