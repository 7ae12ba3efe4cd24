"""``bench replay`` end to end on the tiny Zamba2: three fresh engines (stock, ours, off), one
after another, each in its own process; then one row over HTTP against a served model (slow).

Oracles: greedy outputs are identical across policies (caching must not change them); with
caching off nothing is served from cache; with caching on, the shared system prompts of the
chat workload are.
"""

from __future__ import annotations

import json

import pytest

from vllm_hybrid.cli import main
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine
pytest.importorskip("vllm", reason="the engine tests need the cpu extra")

WORKLOAD = ["--trace", "gen:chat", "--requests", "12", "--scale", "0.15", "--max-tokens", "4"]
WORKLOAD += ["--warmup", "1"]


def _replay(argv: list[str], tmp_path, capsys) -> tuple[dict, str]:
    out = tmp_path / "replay.json"
    assert main(["bench", "replay", *WORKLOAD, "--json", str(out), "--no-progress", *argv]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_offline_stock_ours_off(model_root, tmp_path, capsys) -> None:
    model = str(tiny_model_dir("zamba2", model_root))
    argv = ["--model", model, "--policies", "stock,ours,off", "--blocks", "64", "--rate", "20"]
    result, table = _replay(argv, tmp_path, capsys)
    rows = {s["policy"]: s for s in result["summary"]}
    assert list(rows) == ["stock", "ours", "off"]
    assert result["outputs_identical"]["identical"] is True
    assert result["outputs_identical"]["compared"] == 12
    assert rows["off"]["token_hit_rate"] == 0.0
    assert rows["stock"]["token_hit_rate"] > 0 and rows["ours"]["token_hit_rate"] > 0
    assert all(s["blocks"] == 64 and s["requests"] == 12 for s in rows.values())
    assert all(len(r["records"]) == 12 for r in result["rows"])
    # the scheduler's running count when each request started (at most --max-num-seqs, 16)
    counts = [rec["running_at_start"] for r in result["rows"] for rec in r["records"]]
    assert all(1 <= n <= 16 for n in counts), counts
    assert "greedy outputs identical across policies: yes (12 requests)" in table
    assert "ours/stock: TTFT p50" in table


@pytest.mark.slow
def test_http_row_against_a_server(model_root, tmp_path, capsys) -> None:
    from vllm_hybrid.demo import free_port, start_server, stop_server, wait_ready

    port, log = free_port(), tmp_path / "server.log"
    proc = start_server(tiny_model_dir("zamba2", model_root), port, log)
    try:
        wait_ready(proc, port, log)
        argv = ["--url", f"http://127.0.0.1:{port}", "--label", "served", "--rate", "20"]
        result, table = _replay(argv, tmp_path, capsys)
    finally:
        stop_server(proc)
    (row,) = result["summary"]
    assert row["policy"] == "served" and row["requests"] == 12
    assert row["token_hit_rate"] > 0
    assert all(len(r["output_token_ids"]) == 4 for r in result["rows"][0]["records"])
    assert "served" in table
