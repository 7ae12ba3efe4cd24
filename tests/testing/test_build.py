"""Building checkpoints: determinism by seed, idempotent rebuilds, stamps, CLI."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vllm_hybrid.testing import build_model, tiny_model_dir
from vllm_hybrid.testing.fixtures import weights_digest
from vllm_hybrid.testing.make_model import STAMP_NAME, build_stamp, main, read_stamp

ARCH = "nemotron_h"  # the quickest to build and load


def test_same_seed_same_weights(tmp_path: Path) -> None:
    first = build_model(ARCH, tmp_path / "a", seed=3)
    second = build_model(ARCH, tmp_path / "b", seed=3)
    other = build_model(ARCH, tmp_path / "c", seed=4)
    assert weights_digest(first) == weights_digest(second)
    assert weights_digest(first) != weights_digest(other)
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()
    assert json.loads((first / "config.json").read_text()) == json.loads(
        (other / "config.json").read_text()
    )


def test_rebuild_is_a_no_op(tmp_path: Path) -> None:
    out = build_model(ARCH, tmp_path / "m")
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_model(ARCH, out) == out
    assert weights.stat().st_mtime_ns == before
    build_model(ARCH, out, force=True)
    assert weights.stat().st_mtime_ns != before


def test_changed_arguments_rebuild(tmp_path: Path) -> None:
    out = build_model(ARCH, tmp_path / "m", seed=0)
    digest = weights_digest(out)
    build_model(ARCH, out, seed=1)
    assert read_stamp(out) == build_stamp(ARCH, "tiny", 1, "float32")
    assert weights_digest(out) != digest
    assert len(list(out.glob("*.safetensors"))) == 1


def test_bfloat16_build(tmp_path: Path) -> None:
    out = build_model(ARCH, tmp_path / "bf16", dtype="bfloat16")
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == "bfloat16"


def test_stamp_and_files(model_root: Path) -> None:
    out = tiny_model_dir("zamba2", model_root)
    assert read_stamp(out) == build_stamp("zamba2", "tiny", 0, "float32")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).is_file(), name
    assert tiny_model_dir("zamba2", model_root) == out


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown arch"):
        build_model("mamba3", tmp_path / "x")
    with pytest.raises(ValueError, match="unknown size"):
        build_model(ARCH, tmp_path / "x", size="huge")
    with pytest.raises(ValueError, match="unknown dtype"):
        build_model(ARCH, tmp_path / "x", dtype="int8")
    assert not (tmp_path / "x" / STAMP_NAME).exists()


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--arch", ARCH, "--out", str(tmp_path / "cli"), "--seed", "2"]) == 0
    assert str(tmp_path / "cli") in capsys.readouterr().out
    assert read_stamp(tmp_path / "cli") == build_stamp(ARCH, "tiny", 2, "float32")
    with pytest.raises(SystemExit):
        main(["--arch", "llama", "--out", str(tmp_path / "bad")])
