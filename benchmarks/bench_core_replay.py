"""The core's share of a scheduler step: bench_scheduler's workload, core calls replayed alone.

``bench_scheduler.py`` times a whole step of vLLM's scheduler with ours installed; on a busy
2-core machine its ratio moves by +-0.02 between runs, and it cannot say which part of our
overhead is the core (``PrefixIndex``, the policy, ``RequestFeed``: pure Python) and which is
the adapter around vLLM's pool. This script runs the same workload for one configuration
(``--configs``, default ``flop``), records every call that the adapter makes into the core
(top-level calls only, with their arguments and the victims returned), then replays the log
on a fresh ``PrefixIndex`` + policy + feed, ``--repeats`` times, with nothing else in the loop.

Printed: the calls by kind, the core's time per engine step (median and min over repeats:
a replay runs with warm caches, so this is a lower bound of what the core costs inside an
engine step), and whether every replayed ``pick_victims`` returned exactly the victims the
engine got (the check that the replay is faithful: it fails if the log misses a call).

    .venv/bin/python benchmarks/bench_core_replay.py --steps 200 [--per-call]

``--per-call`` adds one replay with every call timed, printed as a table by kind (calls per
step, us per call, us per step): where the core's share goes.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_scheduler  # noqa: E402  (the workload and the scheduler are bench_scheduler's)

#: The core's methods that the adapter calls (``adapters/vllm/block_pool.py``, ``scheduler.py``).
MIRROR_CALLS = (
    "add",
    "drop_page",
    "move_page",
    "touch_pages",
    "pages_used",
    "pages_freed",
    "pick_victims",
    "pick_snapshot_victims",
    "tick",
    "clear",
    "use_free_events",
    "refresh_lookahead",
)
PICKS = ("pick_victims", "pick_snapshot_victims")


class Recorder:
    """Wraps the core objects of one scheduler, on the instances, and logs their calls."""

    def __init__(self) -> None:
        self.log: list[tuple[str, tuple[Any, ...], list[int] | None]] = []
        self._depth = 0  # calls the core makes to itself are not the adapter's

    def wrapped(self, method: Any, name: str) -> Any:
        """``method``, logging its top-level calls as ``name``."""

        @functools.wraps(method)
        def recorded(*args: Any) -> Any:
            if self._depth:
                return method(*args)
            self._depth += 1
            try:
                if name == "started":  # the last argument is the mirror's node_of
                    self.log.append((name, (*args[:4], list(args[4])), None))
                    return method(*args)
                if name in ("touch_pages", "pages_used", "pages_freed", "use_free_events"):
                    args = (list(args[0]),) if args else ([],)
                out = method(*args)
                if name in PICKS:
                    self.log.append((name, args[:1], list(out)))
                else:
                    self.log.append((name, args, None))
                return out
            finally:
                self._depth -= 1

        return recorded


class RecordingProxy:
    """Stands in for an object (e.g. the compiled ``PrefixIndex``, whose instances take no new
    attribute): logs the calls of ``names`` through ``recorder``, passes everything else on."""

    def __init__(self, recorder: Recorder, inner: Any, names: tuple[str, ...]) -> None:
        object.__setattr__(self, "_proxy", (recorder, inner, names))

    def __getattr__(self, name: str) -> Any:
        recorder, inner, names = object.__getattribute__(self, "_proxy")
        attr = getattr(inner, name)
        return recorder.wrapped(attr, name) if name in names else attr

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(object.__getattribute__(self, "_proxy")[1], name, value)


def record(args: argparse.Namespace) -> tuple[list[Any], dict[str, Any], int]:
    """Run bench_scheduler's workload for ``args.configs`` (one policy) and log the core calls.
    The recording starts on the fresh scheduler (before any request), so the log rebuilds the
    mirror from empty."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    sched, hash_block_size = bench_scheduler.build_scheduler(args.configs, args)
    pool = sched.hybrid_pool
    mirror, feed = pool.hybrid.mirror, pool.hybrid.feed
    recorder = Recorder()
    # the state before the first request (no page is cached, the pool's in-use set as now)
    recorder.log.append(("use_free_events", (sorted(mirror._used),), None))
    # the adapter reaches the mirror as pool.hybrid.mirror: the proxy sees every call it makes
    pool.hybrid.mirror = RecordingProxy(recorder, mirror, MIRROR_CALLS)
    pool.hybrid.feed = RecordingProxy(recorder, feed, ("started",))
    if mirror.lookahead is not None:  # the waiting requests' paths, as the mirror got them
        waiting = mirror.lookahead

        def lookahead() -> list[list[Any]]:
            paths = [list(p) for p in itertools.islice(waiting(), mirror.lookahead_paths)]
            recorder.log.append(("lookahead", (paths,), None))
            return paths

        mirror.lookahead = lookahead
    setup = {
        "policy": mirror.policy.name,
        "cost": feed.cost,
        "key_tokens": feed.key_tokens,
        "mirror": {
            "block_tokens": mirror.block_tokens,
            "kv_groups": sorted(mirror.kv_groups),
            "state_groups": sorted(mirror.state_groups),
            "kv_bytes_per_token": mirror.kv_bytes_per_token,
        },
        "snapshot_budget_pages": mirror.snapshot_budget_pages,
    }
    hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    run = bench_scheduler.Run(
        args.configs, sched, get_request_block_hasher(hash_block_size, hash_fn)
    )
    work = bench_scheduler.Workload(args)
    steps = args.warmup + args.steps
    for n in range(steps):
        bench_scheduler.step(run, work, n, timed=False)
    return recorder.log, setup, steps


def replay(
    log: list[Any], setup: dict[str, Any], per_call: Counter[str] | None = None
) -> tuple[float, int]:
    """One replay on fresh core objects: (seconds, picks whose victims differ from the log).
    A page is in use from ``pages_used``/``touch_pages`` until ``pages_freed``, as vLLM's
    ``ref_cnt`` said when the adapter made those calls. With ``per_call``, each call is timed
    too (``perf_counter_ns``, ~0.1 us of timer per call in the seconds returned) and its
    nanoseconds are added to ``per_call[name]``."""
    from vllm_hybrid.core import POLICIES, PrefixIndex, RequestFeed

    policy = POLICIES[setup["policy"]](setup["cost"])
    mirror = PrefixIndex(policy=policy, **setup["mirror"])
    mirror.snapshot_budget_pages = setup["snapshot_budget_pages"]
    feed = RequestFeed(policy, setup["cost"], setup["key_tokens"])
    used: set[int] = set()
    waiting: list[list[list[Any]]] = []  # the recorded lookahead answers, in order
    if any(name == "lookahead" for name, _, _ in log):
        # a replay that diverged may ask where the engine did not: no waiting paths then
        mirror.lookahead = lambda: waiting.pop(0) if waiting else []

    def is_free(page: int) -> bool:
        return page not in used

    differ = 0
    gc_was_on = gc.isenabled()
    gc.disable()
    clock = time.perf_counter_ns
    t0 = time.perf_counter()
    for name, args, out in log:
        if per_call is not None:
            t_call = clock()
        if name == "started":
            feed.started(*args, mirror.node_of)
        elif name == "lookahead":  # asked inside the pick that follows it in the log
            waiting.append(args[0])
        elif name == "pages_used" or name == "touch_pages":
            used.update(args[0])
            getattr(mirror, name)(args[0])
        elif name == "pages_freed":
            used.difference_update(args[0])
            mirror.pages_freed(args[0])
        elif name in PICKS:
            differ += getattr(mirror, name)(args[0], is_free) != out
        else:
            getattr(mirror, name)(*args)
        if per_call is not None:
            per_call[name] += clock() - t_call
    seconds = time.perf_counter() - t0
    if gc_was_on:
        gc.enable()
    return seconds, differ


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--repeats", type=int, default=7, help="replays of the log")
    extra.add_argument(
        "--per-call",
        action="store_true",
        help="one more replay with every call timed: us per call and per step, by kind",
    )
    mine, rest = extra.parse_known_args(argv)
    args = bench_scheduler.parse_args(["--configs", "flop", *rest])
    if args.configs == "stock" or "," in args.configs:
        raise SystemExit("--configs: one policy name (the core runs only under a policy)")
    if mine.repeats < 1:
        raise SystemExit("--repeats: at least 1")
    log, setup, steps = record(args)
    times, differ = [], 0
    for _ in range(mine.repeats):
        seconds, d = replay(log, setup)
        times.append(seconds)
        differ += d
    kinds = Counter(name for name, _, _ in log)
    median_ms = 1e3 * statistics.median(times) / steps
    print(
        f"{args.configs}: {args.running} running, {args.blocks} blocks, {steps} steps "
        f"({args.warmup} warm-up + {args.steps}) recorded, {len(log)} core calls"
    )
    print("calls per step: " + ", ".join(f"{k} {v / steps:.1f}" for k, v in kinds.most_common()))
    print(
        f"core alone: {median_ms:.3f} ms/step median, {1e3 * min(times) / steps:.3f} min "
        f"over {mine.repeats} replays; victims identical to the engine's: "
        f"{'yes' if differ == 0 else f'NO ({differ} picks differ)'}"
    )
    if mine.per_call:
        spent: Counter[str] = Counter()
        replay(log, setup, spent)
        print(f"{'call':20} {'per step':>8} {'us/call':>8} {'us/step':>8}")
        for name, ns in spent.most_common():
            if name != "lookahead":  # the recorded answers are data, not calls
                print(
                    f"{name:20} {kinds[name] / steps:8.1f} {ns / kinds[name] / 1e3:8.2f}"
                    f" {ns / steps / 1e3:8.1f}"
                )
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
