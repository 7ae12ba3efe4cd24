"""The cluster simulation grid of issue 21: every router at N = 2, 8, 32, 64 replicas.

Workloads: the shared Mooncake trace (all 3,993 requests, 512-token blocks: its own block
size, and in the range of real hybrids' aligned blocks) and the generated gen:chat and
gen:agent (seed 0, 128-token blocks); shapes marconi-7b and zamba2-7b; each replica runs
``flop`` and, as a second axis, stock ``vllm``, under a per-replica budget where one replica
is in the climbing regime (single-replica token hit rate still rising with the budget; the
sweep that chose them is in docs/results/2026-12-03-cluster-sim.md).

Prints one table per (workload, shape), the acceptance check of the issue (at N = 8 and 32:
``state`` saves >= 1.3x the FLOPs of the best other router, has the lowest TTFT p50, and its
load imbalance is at most least-loaded's + 10%), and writes ``--out``/cluster_sim.json and
one PNG per (workload, shape).

    nice -n 19 .venv/bin/python benchmarks/cluster_sim.py --out out/cluster [--quick]

``--quick``: N = 2, 8 only and the first 1,000 Mooncake requests (a smoke run).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from vllm_hybrid.core import CostModel, load_shape
from vllm_hybrid.sim.cluster import run_grid
from vllm_hybrid.sim.cluster_report import format_table, write_plot
from vllm_hybrid.sim.generators import GENERATORS
from vllm_hybrid.sim.routers import ROUTERS
from vllm_hybrid.sim.service import DEFAULT_DECODE_S, DEFAULT_THROUGHPUT
from vllm_hybrid.sim.trace import load_mooncake

MOONCAKE = (
    Path(__file__).resolve().parents[1].parent / "shared/traces/mooncake_synthetic_trace.jsonl"
)
#: (workload, shape) -> (block tokens, per-replica budget in GB: the climbing regime)
GRID = {
    ("mooncake", "marconi-7b"): (512, 64.0),
    ("mooncake", "zamba2-7b"): (512, 1024.0),
    ("gen:chat", "marconi-7b"): (128, 0.5),
    ("gen:chat", "zamba2-7b"): (128, 5.0),
    ("gen:agent", "marconi-7b"): (128, 0.5),
    ("gen:agent", "zamba2-7b"): (128, 5.0),
}


def acceptance(rows: list, n: int, policy: str) -> str:
    by = {r.router: r for r in rows if r.replicas == n and r.policy == policy}
    if "state" not in by:
        return ""
    ours = by["state"]
    others = [r for name, r in by.items() if name != "state"]
    best = max(others, key=lambda r: r.flops_saved)
    ratio = ours.flops_saved / max(best.flops_saved, 1.0)
    p50 = min(others, key=lambda r: r.ttft(0.5))
    ll = by.get("least-loaded")
    imb_ok = ll is None or ours.imbalance <= ll.imbalance * 1.10
    return (
        f"N={n} {policy}: FLOPs saved {ratio:.2f}x best other ({best.router}) "
        f"[{'ok' if ratio >= 1.3 else 'NOT MET'}]; TTFT p50 {ours.ttft(0.5):.3f} s vs "
        f"{p50.ttft(0.5):.3f} s ({p50.router}) "
        f"[{'ok' if ours.ttft(0.5) <= p50.ttft(0.5) else 'NOT MET'}]; imbalance "
        f"{ours.imbalance:.2f} vs least-loaded {ll.imbalance if ll else float('nan'):.2f} "
        f"[{'ok' if imb_ok else 'NOT MET'}]"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="out/cluster")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--replicas", default=None, help="comma-separated N (default 2,8,32,64)")
    ap.add_argument("--only", default=None, help="workload:shape pairs, e.g. gen:chat:marconi-7b")
    ap.add_argument("--policies", default="flop,vllm")
    ap.add_argument("--throughput-tflops", type=float, default=DEFAULT_THROUGHPUT / 1e12)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    replicas = [2, 8] if args.quick else [2, 8, 32, 64]
    if args.replicas:
        replicas = [int(x) for x in args.replicas.split(",")]
    policies = args.policies.split(",")
    results = []
    for (workload, shape), (block, gb) in GRID.items():
        if args.only and f"{workload}:{shape}" not in args.only.split(","):
            continue
        if workload == "mooncake":
            reqs = load_mooncake(MOONCAKE, 1000 if args.quick else None)
        else:
            reqs = GENERATORS[workload[4:]](seed=0)
        cost = CostModel(load_shape(shape), block)
        started = time.perf_counter()
        rows = run_grid(
            reqs,
            cost,
            replicas,
            ROUTERS,
            policies,
            [int(gb * 1e9)],
            throughput_flops=args.throughput_tflops * 1e12,
            decode_s_per_token=DEFAULT_DECODE_S,
        )
        took = time.perf_counter() - started
        print(
            f"\n## {workload}, {shape}: {len(reqs)} requests, {block}-token blocks, "
            f"{gb:g} GB per replica ({took:.0f} s)"
        )
        print(format_table(rows, markdown=True))
        for n in (8, 32):
            for policy in policies:
                line = acceptance(rows, n, policy)
                if line:
                    print("- " + line)
        sys.stdout.flush()
        name = f"{workload.replace(':', '_')}_{shape}"
        write_plot(rows, out / f"{name}.png", f"{workload}, {shape}, {gb:g} GB/replica")
        results.append(
            {
                "workload": workload,
                "shape": shape,
                "block_tokens": block,
                "budget_gb": gb,
                "requests": len(reqs),
                "rows": [r.to_dict() for r in rows],
            }
        )
        (out / "cluster_sim.json").write_text(
            json.dumps(
                {
                    "throughput_flops": args.throughput_tflops * 1e12,
                    "decode_s_per_token": DEFAULT_DECODE_S,
                    "results": results,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
