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
from vllm_hybrid.sim.cluster import run_grid
from vllm_hybrid.sim.cluster_report import format_table
from vllm_hybrid.sim.cluster_report import write_json as write_cluster_json
from vllm_hybrid.sim.cluster_report import write_plot as write_cluster_plot
from vllm_hybrid.sim.generators import GENERATORS
from vllm_hybrid.sim.replay import ProgressFn
from vllm_hybrid.sim.report import format_text, write_json, write_plot
from vllm_hybrid.sim.routers import ROUTERS, UnknownRouterError, check_routers
from vllm_hybrid.sim.runner import UnknownPolicyError, check_policies, run_all
from vllm_hybrid.sim.service import DEFAULT_DECODE_S, DEFAULT_THROUGHPUT
from vllm_hybrid.sim.trace import SimRequest, TraceError, load_mooncake


def add_simulate_parser(subparsers: Any) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "simulate",
        help="replay a trace against hybrid prefix-cache policies",
        description="Replay a Mooncake JSONL trace or a generated workload (gen:chat, "
        "gen:docqa, gen:agent, gen:prefix) against each policy at each budget, with the "
        "infinite-cache bound and a clairvoyant Belady reference.",
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
        default=None,
        help=f"comma-separated, from: {', '.join(POLICIES)} (default: all; with --replicas: "
        "flop, the policy each replica runs)",
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
    p.add_argument(
        "--throughput-tflops",
        type=float,
        default=DEFAULT_THROUGHPUT / 1e12,
        help="prefill TFLOP/s one engine (replica) sustains: the TTFT every row shows, "
        "requests queued FIFO at their arrivals (default %(default)g)",
    )
    p.add_argument("--limit", type=int, default=None, help="only the first N requests")
    p.add_argument("--seed", type=int, default=0, help="seed for gen: workloads")
    p.add_argument("--json", dest="json_out", default=None, help="write results as JSON")
    p.add_argument("--plot", default=None, help="write a PNG plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    c = p.add_argument_group("cluster (docs/cluster.md)")
    c.add_argument(
        "--replicas",
        default=None,
        help="comma-separated replica counts N: simulate N replicas, each with its own "
        "--budget-gb, behind --router",
    )
    c.add_argument(
        "--router",
        default=None,
        help=f"comma-separated, from: {', '.join(ROUTERS)} (default: all; needs --replicas)",
    )
    c.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=DEFAULT_DECODE_S * 1e3,
        help="decode time per generated token of one request (default %(default)g ms)",
    )
    c.add_argument(
        "--overload-wait-s",
        type=float,
        default=2.0,
        help="state router: a session leaves its replica when that replica's queue is this "
        "much longer than the shortest (default %(default)g s)",
    )
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


def _parse_replicas(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--replicas must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--replicas needs integers >= 1 (replica counts), got {text!r}")
    return values


def _split(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def _cluster_options(args: argparse.Namespace) -> tuple[list[int], list[str]] | None:
    """(replica counts, routers) of a cluster run, None for a single-engine run."""
    if args.replicas is None:
        if args.router is not None:
            raise ValueError("--router needs --replicas N (the number of replicas to route to)")
        return None
    replicas = _parse_replicas(args.replicas)
    routers = check_routers(_split(args.router)) if args.router is not None else list(ROUTERS)
    if args.decode_ms_per_token < 0:
        raise ValueError(f"--decode-ms-per-token must be >= 0, got {args.decode_ms_per_token:g}")
    if args.overload_wait_s < 0:
        raise ValueError(f"--overload-wait-s must be >= 0, got {args.overload_wait_s:g}")
    if args.host_gb or args.sglang_pools:
        raise ValueError("--host-gb and --sglang-pools are not simulated with --replicas")
    return replicas, routers


def _run_cluster(
    args: argparse.Namespace,
    requests: list[SimRequest],
    cost: CostModel,
    budgets: list[int],
    policies: list[str],
    cluster: tuple[list[int], list[str]],
) -> int:
    replicas, routers = cluster
    started = time.perf_counter()
    show = _progress(not args.no_progress and sys.stderr.isatty())
    rows = run_grid(
        requests,
        cost,
        replicas,
        routers,
        policies,
        budgets,
        throughput_flops=args.throughput_tflops * 1e12,
        decode_s_per_token=args.decode_ms_per_token / 1e3,
        overload_wait_s=args.overload_wait_s,
        seed=args.seed,
        progress=show,
    )
    for budget in budgets:
        print(
            f"{args.trace}, {cost.shape.name}, {budget / 1e9:g} GB per replica, "
            f"{args.throughput_tflops:g} TFLOP/s, {args.decode_ms_per_token:g} ms/token"
        )
        print(format_table([r for r in rows if r.budget_bytes == budget]))
    print(f"({len(requests)} requests, {time.perf_counter() - started:.1f}s)")
    meta = {
        "workload": args.trace,
        "shape": cost.shape.name,
        "block_tokens": cost.block_tokens,
        "throughput_flops": args.throughput_tflops * 1e12,
        "decode_s_per_token": args.decode_ms_per_token / 1e3,
    }
    if args.json_out:
        write_cluster_json(rows, args.json_out, **meta)
    if args.plot:
        try:
            write_cluster_plot(rows, args.plot, f"{args.trace}, {cost.shape.name}")
        except RuntimeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    return 0


def run_simulate(args: argparse.Namespace) -> int:
    try:
        cluster = _cluster_options(args)
        default = "flop" if cluster is not None else ",".join(POLICIES)
        policies = check_policies(_split(args.policies if args.policies is not None else default))
        budgets = _parse_budgets(args.budget_gb)
        if args.block_tokens <= 0:
            raise ValueError("--block-tokens must be positive")
        if args.host_gb < 0:
            raise ValueError(f"--host-gb must be >= 0, got {args.host_gb:g}")
        if not args.host_gbps > 0:
            raise ValueError(f"--host-gbps must be > 0, got {args.host_gbps:g}")
        if args.sglang_pools < 0:
            raise ValueError(f"--sglang-pools must be >= 0, got {args.sglang_pools:g}")
        if not args.throughput_tflops > 0:
            raise ValueError(f"--throughput-tflops must be > 0, got {args.throughput_tflops:g}")
        cost = CostModel(
            load_shape(args.model), args.block_tokens, int8_snapshots=args.int8_snapshots
        )
        requests = _load_requests(args.trace, args.limit, args.seed)
    except (UnknownPolicyError, UnknownRouterError, ShapeError, TraceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not requests:
        print("error: the workload has no requests", file=sys.stderr)
        return 2
    if cluster is not None:
        return _run_cluster(args, requests, cost, budgets, policies, cluster)
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
        throughput_flops=args.throughput_tflops * 1e12,
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
