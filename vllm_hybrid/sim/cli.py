"""``vllm-hybrid simulate``: replay a trace or a generated workload against every policy.

The main CLI (``vllm_hybrid/cli.py``) calls :func:`add_simulate_parser` and
:func:`run_simulate`; ``python -m vllm_hybrid.sim.cli simulate ...`` works on its own.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from vllm_hybrid.core import (
    MAMBA_FULL_MEMORY_RATIO,
    POLICIES,
    CostModel,
    ShapeError,
    builtin_shape_names,
    load_shape,
)
from vllm_hybrid.sim.generators import GENERATORS
from vllm_hybrid.sim.replay import ProgressFn
from vllm_hybrid.sim.report import format_text, write_json, write_plot
from vllm_hybrid.sim.runner import UnknownPolicyError, check_policies, run_all
from vllm_hybrid.sim.trace import SimRequest, TraceError, load_mooncake


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay a trace against hybrid prefix-cache policies",
        description="Replay a Mooncake JSONL trace or a generated workload (gen:chat, "
        "gen:docqa, gen:agent) against each policy at each budget, with the infinite-cache "
        "bound and a clairvoyant Belady reference.",
    )
    p.add_argument("--trace", required=True, help="PATH to a Mooncake JSONL trace or gen:NAME")
    p.add_argument(
        "--model",
        default="zamba2-7b",
        help=f"shape name ({', '.join(builtin_shape_names())}) or a JSON file",
    )
    p.add_argument("--budget-gb", default="1,2,4,8", help="comma-separated budgets in GB")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated, from: {', '.join(POLICIES)}",
    )
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument(
        "--host-gb",
        type=float,
        default=0.0,
        help="host-memory snapshot tier in GB (0: none); snapshots evicted alone go there",
    )
    p.add_argument(
        "--host-gbps",
        type=float,
        default=25.0,
        help="host <-> device bandwidth in GB/s, for the transfer time of host hits",
    )
    p.add_argument(
        "--int8-snapshots",
        action="store_true",
        help="snapshots stored as int8 SSM states + per-head scales (about half the bytes)",
    )
    p.add_argument(
        "--sglang-pools",
        type=float,
        default=0.0,
        metavar="RATIO",
        help="also run sglang with SGLang's two pools, Mamba/KV bytes = RATIO (its "
        f"--mamba-full-memory-ratio, default {MAMBA_FULL_MEMORY_RATIO}); 0: only one budget",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--seed", type=int, default=0, help="seed for gen: workloads")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _load_requests(spec: str, limit: int | None, seed: int) -> list[SimRequest]:
    if spec.startswith("gen:"):
        name = spec[4:]
        if name not in GENERATORS:
            raise ValueError(f"unknown generator {name!r}; known: {', '.join(GENERATORS)}")
        reqs = GENERATORS[name](seed=seed)
        return reqs[:limit] if limit is not None else reqs
    return load_mooncake(spec, limit)


def _parse_budgets(text: str) -> list[int]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--budget-gb must be comma-separated numbers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise ValueError(f"--budget-gb needs positive numbers, got {text!r}")
    return [int(v * 1e9) for v in values]


def _progress(enabled: bool) -> Any:
    def make(label: str) -> ProgressFn | None:
        if not enabled:
            return None
        last = [-1]

        def show(done: int, total: int) -> None:
            pct = 100 * done // max(total, 1)
            if pct != last[0]:
                last[0] = pct
                bar = "#" * (pct // 4)
                sys.stderr.write(f"\r{label:>10s} [{bar:<25s}] {pct:3d}% ({done}/{total})")
                if done == total:
                    sys.stderr.write("\n")
                sys.stderr.flush()

        return show

    return make


def run_simulate(args: argparse.Namespace) -> int:
    try:
        policies = check_policies([p.strip() for p in args.policies.split(",") if p.strip()])
        budgets = _parse_budgets(args.budget_gb)
        if args.block_tokens <= 0:
            raise ValueError("--block-tokens must be positive")
        if args.host_gb < 0:
            raise ValueError(f"--host-gb must be >= 0, got {args.host_gb:g}")
        if not args.host_gbps > 0:
            raise ValueError(f"--host-gbps must be > 0, got {args.host_gbps:g}")
        if args.sglang_pools < 0:
            raise ValueError(f"--sglang-pools must be >= 0, got {args.sglang_pools:g}")
        cost = CostModel(
            load_shape(args.model), args.block_tokens, int8_snapshots=args.int8_snapshots
        )
        requests = _load_requests(args.trace, args.limit, args.seed)
    except (UnknownPolicyError, ShapeError, TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("error: the workload has no requests", file=sys.stderr)
        return 2
    started = time.perf_counter()
    show = _progress(not args.no_progress and sys.stderr.isatty())
    res = run_all(
        requests,
        cost,
        budgets,
        policies,
        workload=args.trace,
        progress=show,
        host_bytes=int(args.host_gb * 1e9),
        host_bandwidth=args.host_gbps * 1e9,
        sglang_pools=args.sglang_pools,
    )
    print(format_text(res))
    print(f"({len(requests)} requests, {time.perf_counter() - started:.1f}s)")
    if args.json_out:
        write_json(res, args.json_out)
    if args.plot:
        try:
            write_plot(res, args.plot)
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_hybrid.sim.cli")
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(sub)
    args = parser.parse_args(argv)
    return run_simulate(args)


if __name__ == "__main__":
    raise SystemExit(main())
