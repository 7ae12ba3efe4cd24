"""Timing helpers shared by the CPU op benchmarks (bench_gdn.py, bench_kda.py, bench_mamba1.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator

import torch


def timed(fn: Callable[[], object]) -> float:
    """Wall milliseconds of one call of ``fn``."""
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def round_robin(
    rows: dict[str, Callable[[], object]],
    repeats: int,
    before_round: Callable[[], None] | None = None,
) -> list[dict[str, float]]:
    """After one warm-up call of each row, ``repeats`` rounds that time every row once each
    (``before_round`` first, outside the timings): a busy machine slows all rows of a round
    alike, so ratios are taken within a round (:func:`median_ratio`)."""
    for fn in rows.values():
        fn()
    rounds = []
    for _ in range(repeats):
        if before_round is not None:
            before_round()
        rounds.append({name: timed(fn) for name, fn in rows.items()})
    return rounds


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    """Per row, the median of its rounds' milliseconds."""
    return {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}


def median_ratio(rounds: list[dict[str, float]], num: str, den: str) -> float:
    """The median over rounds of row ``num`` / row ``den`` in the same round."""
    return statistics.median(r[num] / r[den] for r in rounds)


def thread_counts(arg: str | None) -> Iterator[int]:
    """The ``--threads`` comma list (default: 1 and all), each set in torch as it is yielded."""
    counts = [int(x) for x in arg.split(",")] if arg else sorted({1, torch.get_num_threads()})
    for n in counts:
        torch.set_num_threads(n)
        yield n
