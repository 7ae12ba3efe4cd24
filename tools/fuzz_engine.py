"""Long differential fuzzing run: many seeded plans across architectures, caching on vs off.

    .venv/bin/python tools/fuzz_engine.py --archs zamba2,nemotron_h,granitemoehybrid,falcon_h1 \
        --requests 200 --seeds 3 [--blocks 40] [--scheduler-cls CLS] [--json out.json]

For each (arch, seed) a plan of N requests (shared prefixes cut on and around block boundaries,
branches, near-empty prompts, n = 2, stop tokens, aborts, and by default a tenth of the requests
preceded in their step by their own next turn) runs once with caching off and once
with caching on in a small pool (eviction and preemption), and every request finished in both
is compared token for token. Prints one row per run and the totals; exits 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.engine.conftest import engine  # noqa: E402
from vllm_hybrid.testing.fixtures import engine_dtype, tiny_model_dir  # noqa: E402
from vllm_hybrid.testing.fuzz import Arrival, compare, make_plan, run_plan  # noqa: E402


def one_run(arch: str, seed: int, args: argparse.Namespace, root: str) -> dict[str, object]:
    pressure = {
        "num_gpu_blocks_override": args.blocks,
        "max_num_seqs": 6,
        "max_num_batched_tokens": 256,
        "max_model_len": 2048,
        "dtype": engine_dtype(arch),
    }
    # debug: the hybrid cache's integrity is checked after every scheduler step
    debug = {"additional_config": {"vllm_hybrid": {"debug": True}}}
    cached_kwargs = dict(pressure, enable_prefix_caching=True, **debug)
    if args.scheduler_cls:
        cached_kwargs["scheduler_cls"] = args.scheduler_cls
    model_dir = tiny_model_dir(arch, root)
    plan = make_plan(seed, n_requests=args.requests, extension_first_rate=args.extension_first_rate)
    start = time.perf_counter()
    with engine(model_dir, enable_prefix_caching=False, **pressure) as llm:
        reference = run_plan(llm, plan)
    with engine(model_dir, **cached_kwargs) as llm:
        tested = run_plan(llm, plan)
        scheduler = llm.llm_engine.engine_core.engine_core.scheduler
        checks = getattr(scheduler, "hybrid_checks", 0)
    compared, bad = compare(reference, tested)
    return {
        "arch": arch,
        "seed": seed,
        "requests": sum(isinstance(e, Arrival) for e in plan),
        "compared": compared,
        "sampled": len(tested.sampled),
        "aborted": len(tested.aborted),
        "mismatches": bad,
        "hit_tokens": sum(tested.cached_tokens.values()),
        "integrity_checks": checks,
        "seconds": round(time.perf_counter() - start, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--archs", default="zamba2,nemotron_h,granitemoehybrid,falcon_h1")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=100)
    parser.add_argument("--blocks", type=int, default=40, help="pool size (forces eviction)")
    parser.add_argument("--scheduler-cls", default=None)
    parser.add_argument(
        "--extension-first-rate",
        type=float,
        default=0.1,
        help="share of requests preceded in their step by their own next turn (0: off)",
    )
    parser.add_argument("--json", dest="json_out")
    args = parser.parse_args()
    rows = []
    print(
        f"{'arch':>17} {'seed':>5} {'requests':>8} {'compared':>8} {'n=2':>4} {'aborted':>7}"
        f" {'hit tokens':>10} {'checks':>6} {'mismatches':>10} {'s':>6}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as root:
        for arch in args.archs.split(","):
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                row = one_run(arch, seed, args, root)
                rows.append(row)
                print(
                    f"{arch:>17} {seed:>5} {row['requests']:>8} {row['compared']:>8}"
                    f" {row['sampled']:>4} {row['aborted']:>7} {row['hit_tokens']:>10}"
                    f" {row['integrity_checks']:>6}"
                    f" {len(row['mismatches']):>10} {row['seconds']:>6}",
                    flush=True,
                )
    total = sum(int(r["requests"]) for r in rows)
    bad = sum(len(r["mismatches"]) for r in rows)
    print(
        f"total: {total} requests, {sum(int(r['compared']) for r in rows)} compared, "
        f"{bad} mismatches"
    )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(rows, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
