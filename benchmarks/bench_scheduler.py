"""Scheduler overhead with no model: vLLM's ``Scheduler`` vs ``HybridScheduler`` on a full cache.

What is timed: one scheduler step, ``schedule()`` + ``update_from_output()``, on vLLM 0.32.0's
real ``Scheduler`` built from a real ``VllmConfig`` (a tiny random-weight Zamba2 directory gives
the model config) and a hand-made ``KVCacheConfig``: one ``FullAttentionSpec`` group and
``--mamba-groups`` ``MambaSpec`` groups (``mamba_cache_mode="align"``), all ``--block-tokens``
tokens per block, prefix caching on. No model runs: each step's ``ModelRunnerOutput`` samples one
token for every request whose prompt is fully computed.

Workload: ``--running`` requests are kept in flight. Each prompt is one of ``--prefixes`` shared
prefixes (``--prefix-blocks`` blocks) + a unique part (``--unique-tokens``); each request decodes
``--decode-tokens`` tokens then finishes and is replaced by a new one, so cached blocks of
finished requests fill the pool and allocations must evict (``evicted/step`` shows it).

Every configuration (``stock`` = vLLM's ``Scheduler``; ``flop``, ``vllm``, ... =
``HybridScheduler`` with that ``VLLM_HYBRID_POLICY``) gets the same request stream; they are
stepped round-robin in one process, so machine noise hits all of them alike. ``--warmup`` steps
(not timed) fill the cache first.

Garbage collection (``--gc``): a young-generation collection costs what is young in the whole
process (mostly the prompt lists of the requests every configuration adds, ~2-10 ms here), and
in one round-robin process the step that crosses Python's threshold pays for all of it, so
with ``--gc auto`` nearly every collection lands in a step of whichever configuration allocates
most inside its timed region. The default, ``--gc between``, collects the young generation
before every step, untimed, so no timed step pays for others' garbage; what a step adds to the
collector's work is shown as ``objs/step`` (net GC-tracked objects allocated in the timed
region; collections are proportional to it in a one-scheduler engine).

Clock (``--clock``): ``wall`` (default) times the step on ``perf_counter``; ``cpu`` on this
thread's CPU time (``thread_time``), so that waits for a core on a loaded machine do not count
(the scheduler is single-threaded; what other jobs still cost, in caches and memory bandwidth,
hits every configuration alike). The fake model output built between ``schedule()`` and
``update_from_output()`` is not timed.

Ratios: ``ratio`` and ``p95 ratio`` (ours / stock of the median and the p95: the issue's
figure), and ``paired``: the median over steps of ours / stock for the same step (the same
requests, stepped back to back), which a load that changes during the run moves less.

    .venv/bin/python benchmarks/bench_scheduler.py --steps 200 --json out/bench_scheduler.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Step clocks (``--clock``).
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--configs",
        default="stock,flop,vllm",
        help="stock and/or policy names",
    )
    p.add_argument("--running", type=int, default=256, help="requests kept in flight")
    p.add_argument("--steps", type=int, default=200, help="timed steps per configuration")
    p.add_argument("--warmup", type=int, default=150, help="untimed steps first (fill the cache)")
    p.add_argument("--blocks", type=int, default=2000, help="blocks in the shared pool")
    p.add_argument("--block-tokens", type=int, default=128)
    p.add_argument("--mamba-groups", type=int, default=1)
    p.add_argument("--prefixes", type=int, default=32, help="distinct shared prefixes")
    p.add_argument("--prefix-blocks", type=int, default=4, help="blocks per shared prefix")
    p.add_argument("--unique-tokens", type=int, default=200, help="unique prompt tail per request")
    p.add_argument(
        "--decode-tokens", type=int, default=48, help="mean output tokens (uniform, d/2..3d/2)"
    )
    p.add_argument("--batched-tokens", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument(
        "--match-unit",
        type=int,
        default=None,
        help="vLLM's prefix_match_unit (tokens per block hash; default: the block size)",
    )
    p.add_argument(
        "--hash-algo",
        default=None,
        help="vLLM's prefix_caching_hash_algo (sha256 by default, xxhash, ...)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", default=None, help="model dir for the ModelConfig (tiny zamba2)")
    p.add_argument(
        "--clock",
        choices=sorted(CLOCKS),
        default="wall",
        help="wall: perf_counter (an idle machine); cpu: this thread's CPU time "
        "(thread_time), which a loaded machine's waits for a core do not inflate",
    )
    p.add_argument("--profile", default=None, help="config name to run under cProfile (top 25)")
    p.add_argument("--check", action="store_true", help="integrity checks after every step")
    p.add_argument(
        "--gc",
        choices=("between", "auto"),
        default="between",
        help="between: collect the young generation before every step, untimed (a step never "
        "pays for a collection that the other configurations' garbage triggered); auto: "
        "Python's automatic collection, whichever step crosses the threshold pays",
    )
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------- building
def vllm_config(args: argparse.Namespace) -> Any:
    """Sync scheduling (the CPU platform's), 8192 tokens of model length."""
    from vllm_hybrid.testing.sched_harness import build_vllm_config

    model_dir = args.model_dir
    if model_dir is None:
        from vllm_hybrid.testing.fixtures import tiny_model_dir

        model_dir = str(tiny_model_dir("zamba2", ROOT / "out" / "models"))
    return build_vllm_config(
        model_dir,
        prefix_caching=True,
        block_tokens=args.block_tokens,
        num_blocks=args.blocks,
        max_num_seqs=args.running,
        max_batched_tokens=args.batched_tokens,
        async_scheduling=False,
        max_model_len=8192,
        **{
            key: value
            for key, value in (
                # the block size unless asked: the plugin's own default (1 for a hybrid)
                # would apply to whichever policy builds the shared config
                ("prefix_match_unit", args.match_unit or args.block_tokens),
                ("prefix_caching_hash_algo", args.hash_algo),
            )
            if value is not None
        },
    )


def kv_cache_config(args: argparse.Namespace) -> Any:
    from vllm_hybrid.testing.sched_harness import build_kv_cache_config

    return build_kv_cache_config(
        args.block_tokens, args.blocks, args.mamba_groups, state_shapes=((3, 256), (4, 64, 32))
    )


def build_scheduler(name: str, args: argparse.Namespace) -> Any:
    """vLLM's ``Scheduler`` ("stock") or ``HybridScheduler`` with policy ``name``."""
    from vllm.v1.core.sched.scheduler import Scheduler

    from vllm_hybrid.adapters.vllm.scheduler import HybridScheduler
    from vllm_hybrid.testing.sched_harness import construct_scheduler

    cls = Scheduler
    if name != "stock":
        os.environ["VLLM_HYBRID_POLICY"] = name
        cls = HybridScheduler
    sched, hash_block_size = construct_scheduler(cls, vllm_config(args), kv_cache_config(args))
    if name != "stock" and sched.hybrid_pool is None:
        raise RuntimeError("HybridScheduler did not activate on this KV cache config")
    return sched, hash_block_size


# ---------------------------------------------------------------------------------- workload
class Workload:
    """The same request stream for every configuration (prompts from a seeded generator)."""

    def __init__(self, args: argparse.Namespace) -> None:
        rng = random.Random(args.seed)
        self.args = args
        self.rng = rng
        vocab = range(10, 30000)
        n = args.prefix_blocks * args.block_tokens
        self.prefixes = [[rng.choice(vocab) for _ in range(n)] for _ in range(args.prefixes)]
        self.prompts: list[list[int]] = []
        self.decodes: list[int] = []

    def prompt(self, i: int) -> list[int]:
        while len(self.prompts) <= i:
            prefix = self.rng.choice(self.prefixes)
            tail = [self.rng.randrange(10, 30000) for _ in range(self.args.unique_tokens)]
            self.prompts.append(prefix + tail)
            d = self.args.decode_tokens
            self.decodes.append(self.rng.randint(max(1, d // 2), d + d // 2))
        return self.prompts[i]

    def decode_tokens(self, i: int) -> int:
        self.prompt(i)
        return self.decodes[i]


@dataclass
class Run:
    """One configuration: its scheduler, its requests, its timings."""

    name: str
    sched: Any
    hasher: Any
    next_id: int = 0
    step_s: list[float] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    running: list[int] = field(default_factory=list)
    evict_count: int = 0
    finished: int = 0
    objects: list[int] = field(default_factory=list)  # net GC-tracked allocations per step

    def count_evictions(self) -> None:
        """Count blocks whose hashes are dropped (for reuse or by the engine), both kinds."""
        pool = self.sched.kv_cache_manager.block_pool
        inner = pool._remove_cached_block_hashes

        def counted(block: Any) -> Any:
            removed = inner(block)
            if removed:
                self.evict_count += 1
            return removed

        pool._remove_cached_block_hashes = counted


def add_requests(run: Run, work: Workload) -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    sched = run.sched
    missing = work.args.running - len(sched.running) - len(sched.waiting)
    for _ in range(missing):
        i = run.next_id
        run.next_id += 1
        params = SamplingParams(max_tokens=work.decode_tokens(i), ignore_eos=True)
        req = Request(
            request_id=f"r{i}",
            prompt_token_ids=list(work.prompt(i)),
            sampling_params=params,
            pooling_params=None,
            arrival_time=float(i),
            block_hasher=run.hasher,
        )
        sched.add_request(req)


def fake_output(sched: Any, out: Any, step: int) -> Any:
    from vllm.v1.outputs import ModelRunnerOutput

    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in req_ids:
        req = sched.requests[rid]
        done = req.num_computed_tokens >= req.num_tokens
        sampled.append([10 + (step * 7 + len(rid)) % 20000] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids,
        req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
        sampled_token_ids=sampled,
    )


def step(run: Run, work: Workload, n: int, timed: bool) -> None:
    add_requests(run, work)
    before = run.evict_count
    sched = run.sched
    if work.args.gc == "between":
        gc.collect(0)  # untimed; the step's own allocations stay far below the threshold
    clock = CLOCKS[work.args.clock]
    objects0 = gc.get_count()[0]
    t0 = clock()
    out = sched.schedule()
    t1 = clock()
    model_out = fake_output(sched, out, n)  # the model's part: not the scheduler's time
    t2 = clock()
    results = sched.update_from_output(out, model_out)
    t3 = clock()
    objects = gc.get_count()[0] - objects0  # < 0 if a collection ran (auto mode)
    for outputs in results.values():
        run.finished += sum(o.finish_reason is not None for o in outputs.outputs)
    pool = getattr(sched, "hybrid_pool", None)
    if work.args.check and pool is not None:  # correctness run: O(pool) checks, untimed
        pool.hy_check_integrity()
        pool.hybrid.mirror.check_integrity(pool._hy_is_free)
    if timed:
        run.step_s.append((t1 - t0) + (t3 - t2))
        run.evicted.append(run.evict_count - before)
        run.running.append(len(sched.running))
        if objects >= 0:
            run.objects.append(objects)


# ---------------------------------------------------------------------------------- report
def summary(run: Run, args: argparse.Namespace) -> dict[str, Any]:
    ms = sorted(1e3 * s for s in run.step_s)
    pool = run.sched.kv_cache_manager.block_pool
    row: dict[str, Any] = {
        "config": run.name,
        "median_ms": statistics.median(ms),
        "p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))],
        "mean_ms": statistics.fmean(ms),
        "evicted_per_step": statistics.fmean(run.evicted),
        "steps_with_evictions": sum(e > 0 for e in run.evicted) / len(run.evicted),
        "running_mean": statistics.fmean(run.running),
        "finished": run.finished,
        "gc_objects_per_step": statistics.fmean(run.objects) if run.objects else float("nan"),
        "free_blocks_end": pool.get_num_free_blocks(),
    }
    if run.name != "stock":  # a HybridScheduler
        row["policy_pages"] = pool.hybrid.policy_pages
        row["fallback_pages"] = pool.hybrid.fallback_pages
        row["evict_calls"] = pool.hybrid.evict_calls
    return row


def print_table(rows: list[dict[str, Any]]) -> None:
    stock = next((r for r in rows if r["config"] == "stock"), None)
    head = f"{'config':8} {'median ms':>9} {'p95 ms':>7} {'ratio':>6} {'p95 ratio':>9}"
    head += f" {'paired':>6}"
    print(
        head.replace("config  ", "config        ")
        + f" {'evicted/step':>12} {'steps evicting':>14} {'running':>7} {'fallback':>8}"
        + f" {'objs/step':>9}"
    )
    for r in rows:
        ratio = r["median_ms"] / stock["median_ms"] if stock else float("nan")
        p95 = r["p95_ms"] / stock["p95_ms"] if stock else float("nan")
        r["ratio_median"], r["ratio_p95"] = ratio, p95
        fb = r.get("fallback_pages", "-")
        print(
            f"{r['config']:14} {r['median_ms']:9.2f} {r['p95_ms']:7.2f} {ratio:6.2f} {p95:9.2f}"
            f" {r.get('ratio_paired', float('nan')):6.2f}"
            f" {r['evicted_per_step']:12.1f} {r['steps_with_evictions']:14.0%}"
            f" {r['running_mean']:7.0f} {fb!s:>8} {r['gc_objects_per_step']:9.1f}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_start = os.getloadavg()[0]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    work = Workload(args)
    runs = []
    for name in args.configs.split(","):
        sched, hash_block_size = build_scheduler(name, args)
        hash_fn = get_hash_fn_by_name(sched.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        run = Run(name, sched, get_request_block_hasher(hash_block_size, hash_fn))
        run.count_evictions()
        runs.append(run)
    profiler = None
    if args.profile:
        import cProfile

        profiler = cProfile.Profile()
    gc.collect()
    for n in range(args.warmup + args.steps):
        timed = n >= args.warmup
        for run in runs:
            prof = profiler is not None and timed and run.name == args.profile
            if prof:
                profiler.enable()
            step(run, work, n, timed)
            if prof:
                profiler.disable()
    rows = [summary(run, args) for run in runs]
    stock_run = next((run for run in runs if run.name == "stock"), None)
    for run, row in zip(runs, rows, strict=True):
        if stock_run is not None:  # step n of every configuration served the same requests
            pairs = [a / b for a, b in zip(run.step_s, stock_run.step_s, strict=True)]
            row["ratio_paired"] = statistics.median(pairs)
    print(
        f"{args.running} running, {args.blocks} blocks x {args.block_tokens} tokens, "
        f"1 attention + {args.mamba_groups} Mamba groups, {args.steps} timed steps "
        f"after {args.warmup} warm-up, gc {args.gc}, clock {args.clock}, "
        f"match unit {runs[0].sched.cache_config.prefix_match_unit or args.block_tokens}, "
        f"hash {runs[0].sched.cache_config.prefix_caching_hash_algo}, "
        f"load average {load_start:.1f} at start, {os.getloadavg()[0]:.1f} at end"
    )
    print_table(rows)
    if profiler is not None:
        import pstats

        pstats.Stats(profiler).sort_stats(os.environ.get("PROFILE_SORT", "cumulative")).print_stats(
            os.environ.get("PROFILE_FILTER", ""), 25
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        load = {"start": load_start, "end": os.getloadavg()[0]}
        Path(args.json).write_text(
            json.dumps(
                {"args": vars(args), "load_average": load, "rows": rows},
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
