"""``benchmarks/bench_core_replay.py``: the recorded core calls replay to the engine's victims."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest

from vllm_hybrid.testing.fixtures import tiny_model_dir

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_core_replay  # noqa: E402

SMALL = ["--running", "32", "--blocks", "120", "--warmup", "40", "--steps", "30"]


@pytest.fixture(scope="module")
def recorded(model_root: Path) -> tuple[list, dict, int]:
    model = str(tiny_model_dir("zamba2", model_root))
    args = bench_core_replay.bench_scheduler.parse_args(
        ["--configs", "flop", *SMALL, "--model-dir", model]
    )
    return bench_core_replay.record(args)


def test_replay_reproduces_the_engines_victims(recorded: tuple[list, dict, int]) -> None:
    log, setup, steps = recorded
    picks = [out for name, _, out in log if name in bench_core_replay.PICKS]
    assert steps == 70 and sum(map(len, picks)) > 50  # the pool was full: it evicted
    seconds, differ = bench_core_replay.replay(log, setup)
    assert differ == 0 and seconds > 0


def test_replay_notices_a_different_core(recorded: tuple[list, dict, int]) -> None:
    """The check can fail: the same calls under another policy pick other victims, and a log
    missing the engine's releases (the pages it freed) makes victims unavailable."""
    log, setup, _ = recorded
    assert bench_core_replay.replay(log, {**setup, "policy": "vllm"})[1] > 0
    no_frees = [call for call in log if call[0] != "pages_freed"]
    assert bench_core_replay.replay(no_frees, setup)[1] > 0


def test_per_call_times_every_kind_of_call(recorded: tuple[list, dict, int]) -> None:
    log, setup, _ = recorded
    spent: Counter[str] = Counter()
    _, differ = bench_core_replay.replay(log, setup, spent)
    calls = {name for name, _, _ in log} - {"lookahead"}
    assert differ == 0 and set(spent) >= calls and all(spent[name] > 0 for name in calls)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit, match="one policy name"):
        bench_core_replay.main(["--configs", "stock,flop"])
    with pytest.raises(SystemExit, match="at least 1"):
        bench_core_replay.main(["--repeats", "0"])


def test_bench_scheduler_passes_the_match_unit_and_hash_to_vllm(model_root: Path) -> None:
    model = str(tiny_model_dir("zamba2", model_root))
    bench = bench_core_replay.bench_scheduler
    args = bench.parse_args(["--model-dir", model, "--match-unit", "16", "--hash-algo", "sha256"])
    cache = bench.vllm_config(args).cache_config
    assert (cache.prefix_match_unit, cache.prefix_caching_hash_algo) == (16, "sha256")
    default = bench.vllm_config(bench.parse_args(["--model-dir", model])).cache_config
    assert default.prefix_match_unit in (None, 128)  # vLLM's default: the block size


def test_the_plugin_gives_a_hybrid_a_match_unit_of_one_unless_told_otherwise(
    model_root: Path,
) -> None:
    """``adapters/vllm/config.py::configure_match_unit`` on the config
    ``EngineArgs.create_engine_config`` builds (the tiny Zamba2: a hybrid in align mode)."""
    from vllm_hybrid.testing.sched_harness import build_vllm_config

    model = tiny_model_dir("zamba2", model_root)
    common = dict(
        prefix_caching=True, block_tokens=128, num_blocks=64, max_num_seqs=4, max_batched_tokens=512
    )

    def unit(**kwargs: object) -> int | None:
        return build_vllm_config(model, **common, **kwargs).cache_config.prefix_match_unit

    assert unit() == 1  # ours: exact resume
    assert unit(prefix_match_unit=16) == 16  # the user's setting wins
    assert unit(hybrid={"match_unit": "block"}) is None  # vLLM's default (the block)
    assert unit(hybrid={"match_unit": 32}) == 32
    assert unit(hybrid={"policy": "stock"}) is None  # stock: vLLM untouched
    no_caching = dict(common, prefix_caching=False)
    assert build_vllm_config(model, **no_caching).cache_config.prefix_match_unit is None
