"""Bad input to ``vllm-hybrid bench replay``: exit code 2 and one line on stderr, before any
engine starts."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_hybrid.cli import main


def _fails(capsys: pytest.CaptureFixture[str], argv: list[str], message: str) -> None:
    assert main(["bench", "replay", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("vllm-hybrid bench replay: ") and message in err, err


def test_missing_trace_file(capsys, tmp_path) -> None:
    _fails(
        capsys, ["--trace", str(tmp_path / "none.jsonl"), "--model", "x"], "trace file not found"
    )


def test_malformed_trace(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1}\n')
    _fails(capsys, ["--trace", str(bad), "--model", "x"], "missing field 'hash_ids'")
    bad.write_text("not json\n")
    _fails(capsys, ["--trace", str(bad), "--model", "x"], "bad.jsonl:1: invalid JSON")


def test_unknown_generator(capsys) -> None:
    _fails(capsys, ["--trace", "gen:nope", "--model", "x"], "unknown generator 'nope'")


def test_unknown_policy(capsys, tmp_path) -> None:
    argv = ["--trace", "gen:chat", "--model", str(tmp_path), "--policies", "stock,best"]
    _fails(capsys, argv, "unknown policy 'best'; known: stock, ours, off")


def test_model_dir_missing(capsys, tmp_path) -> None:
    _fails(
        capsys, ["--trace", "gen:chat", "--model", str(tmp_path / "m")], "model directory not found"
    )
    _fails(capsys, ["--trace", "gen:chat"], "--model DIR is required")


def test_nothing_fits_max_len(capsys, tmp_path) -> None:
    argv = ["--trace", "gen:docqa", "--model", str(tmp_path), "--max-len", "64", "--requests", "3"]
    _fails(capsys, argv, "no request fits --max-len 64")


def test_bad_rate_and_time_scale(capsys, tmp_path: Path) -> None:
    base = ["--trace", "gen:chat", "--model", str(tmp_path), "--requests", "3"]
    _fails(capsys, [*base, "--rate", "fast"], "--rate must be a number or auto")
    _fails(capsys, [*base, "--rate", "-1"], "--rate must be positive")
    _fails(capsys, [*base, "--time-scale", "-1"], "--time-scale must be >= 0")
    _fails(capsys, [*base, "--load-window", "-2"], "--load-window must be >= 0")
    _fails(capsys, [*base, "--rate", "2", "--load-window", "-2"], "--load-window must be >= 0")


def test_bad_skip_and_skipping_past_the_end(capsys, tmp_path: Path) -> None:
    base = ["--trace", "gen:chat", "--model", str(tmp_path), "--requests", "3"]
    _fails(capsys, [*base, "--skip", "-1"], "--skip must be >= 0")
    _fails(capsys, [*base, "--skip", "100000"], "no request fits")
