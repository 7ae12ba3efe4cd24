"""Simulator table: the host-memory snapshot tier and int8 snapshots, on the Mooncake trace at
tight device budgets (issue 5's acceptance table).

Every row replays the whole trace once (``vllm_hybrid.sim.replay.replay``, the same policy code
the engine runs) with one configuration:

* ``device``: snapshots and KV in the device budget only (today's engine);
* ``+host``: plus a host-memory tier of ``--host-gb`` for snapshots (``core/host_tier.py``);
* ``int8``: snapshots stored as int8 SSM states + per-head scales (``CostModel(int8_snapshots)``);
* ``int8+host``: both.

Columns: token hit rate, prefill FLOPs saved, hits served from the host and the bytes' transfer
time at ``--host-gbps`` (on the critical path of those requests), and the net compute time saved
at ``--tflops`` of effective prefill throughput: ``FLOPs saved / throughput - transfer time``.

    .venv/bin/python benchmarks/simulate_tiers.py [--json out/sim_tiers.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from vllm_hybrid.core import POLICIES, CostModel, load_shape  # noqa: E402
from vllm_hybrid.sim.replay import replay  # noqa: E402
from vllm_hybrid.sim.trace import KeyedRequest, load_mooncake  # noqa: E402

TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
#: (label, int8 snapshots, host tier)
CONFIGS = (
    ("device", False, False),
    ("+host", False, True),
    ("int8", True, False),
    ("int8+host", True, True),
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(TRACE))
    p.add_argument("--shapes", default="marconi-7b:4,16;zamba2-7b:16,64", help="shape:GB,GB;...")
    p.add_argument("--policies", default="flop,vllm,sglang")
    p.add_argument("--host-gb", type=float, default=256.0)
    p.add_argument("--host-gbps", type=float, default=25.0)
    p.add_argument("--tflops", type=float, default=400.0, help="effective prefill TFLOP/s")
    p.add_argument("--block-tokens", type=int, default=64)
    p.add_argument("--limit", type=int, default=None)
    p.add_argument("--json", dest="json_out", default=None)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    reqs = load_mooncake(args.trace, args.limit)
    keyed = [KeyedRequest(r, args.block_tokens) for r in reqs]
    policies = [p for p in args.policies.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        print(f"error: unknown policy {unknown}; known: {', '.join(POLICIES)}", file=sys.stderr)
        return 2
    rows: list[dict] = []
    head = (
        f"{'shape':<11} {'dev GB':>6} {'config':<10} {'policy':<7} {'token hit':>9} "
        f"{'FLOPs saved':>11} {'host hits':>9} {'transfer s':>10} {'net s saved':>11} "
        f"{'snapshot MB':>11}"
    )
    print(
        f"{len(reqs)} requests, {args.block_tokens}-token blocks, host tier {args.host_gb:g} GB "
        f"at {args.host_gbps:g} GB/s, {args.tflops:g} TFLOP/s"
    )
    print(head)
    started = time.perf_counter()
    for spec in args.shapes.split(";"):
        shape_name, budgets = spec.split(":")
        shape = load_shape(shape_name)
        for budget_gb in (float(b) for b in budgets.split(",")):
            for config, int8, with_host in CONFIGS:
                cost = CostModel(shape, args.block_tokens, int8_snapshots=int8)
                for name in policies:
                    s = replay(
                        keyed,
                        cost,
                        POLICIES[name](cost),
                        int(budget_gb * 1e9),
                        host_bytes=int(args.host_gb * 1e9) if with_host else 0,
                        host_bandwidth=args.host_gbps * 1e9,
                    )
                    net = s.flops_saved / (args.tflops * 1e12) - s.promote_seconds
                    row = {
                        "shape": shape_name,
                        "device_gb": budget_gb,
                        "config": config,
                        "snapshot_bytes": cost.snapshot_bytes,
                        **s.to_dict(),
                        "net_seconds_saved": net,
                    }
                    rows.append(row)
                    print(
                        f"{shape_name:<11} {budget_gb:>6g} {config:<10} {name:<7} "
                        f"{100 * s.token_hit_rate:>8.1f}% {100 * s.flops_saved_rate:>10.1f}% "
                        f"{s.host_hits:>9} {s.promote_seconds:>10.2f} {net:>11.1f} "
                        f"{cost.snapshot_bytes / 1e6:>11.1f}",
                        flush=True,
                    )
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
