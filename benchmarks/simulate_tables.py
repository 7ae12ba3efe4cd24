"""Acceptance tables for docs/policies.md: every policy + Belady + infinite bound, on the
Mooncake trace and each generator, with two model shapes at four budgets, plus plots.

    .venv/bin/python benchmarks/simulate_tables.py [--jobs 2] [--trace PATH]

Rewrites the part of docs/policies.md between the ``tables`` markers, writes
docs/img/sim_<workload>_<shape>.png and out/sim/<workload>_<shape>.json.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from multiprocessing import Pool
from pathlib import Path

from vllm_hybrid.core import POLICIES, CostModel, load_shape
from vllm_hybrid.sim.generators import GENERATORS
from vllm_hybrid.sim.report import format_markdown, to_json, write_plot
from vllm_hybrid.sim.runner import run_all
from vllm_hybrid.sim.trace import load_mooncake

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"
BLOCK_TOKENS = 64
# Budgets (GB) from tight to roomy, per shape: zamba2-7b holds 373 KB of KV per token,
# marconi-7b 16 KB, so the same GB hold very different numbers of tokens.
BUDGETS = {
    ("mooncake", "zamba2-7b"): (16, 64, 256, 1024),
    ("mooncake", "marconi-7b"): (4, 16, 64, 256),
    ("gen", "zamba2-7b"): (4, 16, 64, 256),
    ("gen", "marconi-7b"): (1, 4, 16, 64),
}
SHAPES = ("zamba2-7b", "marconi-7b")
WORKLOADS = ("mooncake", "chat", "docqa", "agent")


def run_job(job: tuple[str, str, str]) -> tuple[str, str, str, dict, float]:
    workload, shape, trace = job
    reqs = load_mooncake(trace) if workload == "mooncake" else GENERATORS[workload](seed=0)
    budgets = BUDGETS[("mooncake" if workload == "mooncake" else "gen", shape)]
    cost = CostModel(load_shape(shape), BLOCK_TOKENS)
    started = time.perf_counter()
    res = run_all(reqs, cost, [int(b * 1e9) for b in budgets], list(POLICIES), workload=workload)
    seconds = time.perf_counter() - started
    write_plot(res, ROOT / "docs" / "img" / f"sim_{workload}_{shape}.png")
    md = format_markdown(res)
    md += f"\n![{workload} {shape}](img/sim_{workload}_{shape}.png)\n"
    return workload, shape, md, to_json(res), seconds


def _summary(results: list[tuple[str, str, str, dict, float]]) -> str:
    lines = [
        "| workload | shape | budget GB | flop | best baseline | flop/best | belady | "
        "headroom closed | TTFT p50 flop / best baseline, s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, shape, _, data, _ in results:
        for budget, entry in data["budgets"].items():
            rows = entry["rows"]
            base = {
                n: rows[n]["flops_saved_rate"] for n in ("vllm", "lru-dense", "sglang", "marconi")
            }
            best_name = max(base, key=lambda n: base[n])
            best = base[best_name]
            ours = rows["flop"]["flops_saved_rate"]
            ratio = f"{ours / best:.2f}x" if best > 0 else "n/a"
            closed = entry["headroom_closed"]
            closed_s = f"{100 * closed:.0f}%" if closed is not None else "n/a"
            ttft = f"{rows['flop']['ttft_p50_s']:.3g} / {rows[best_name]['ttft_p50_s']:.3g}"
            lines.append(
                f"| {workload} | {shape} | {int(budget) / 1e9:g} | {100 * ours:.1f}% | "
                f"{100 * best:.1f}% ({best_name}) | {ratio} | "
                f"{100 * rows['belady']['flops_saved_rate']:.1f}% | {closed_s} | {ttft} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--trace", default=str(TRACE))
    args = ap.parse_args()
    jobs = [(w, s, args.trace) for s in SHAPES for w in WORKLOADS]
    with Pool(args.jobs) as pool:
        results = pool.map(run_job, jobs, chunksize=1)
    out_dir = ROOT / "out" / "sim"
    out_dir.mkdir(parents=True, exist_ok=True)
    for workload, shape, _, data, seconds in results:
        data["seconds"] = seconds
        (out_dir / f"{workload}_{shape}.json").write_text(json.dumps(data, indent=2))
        print(f"{workload:9s} {shape:11s} {seconds:6.1f}s")
    body = "### Summary: FLOPs saved\n\n" + _summary(results) + "\n\n"
    body += "\n".join(md for _, _, md, _, _ in results)
    doc = ROOT / "docs" / "policies.md"
    text = doc.read_text()
    new = re.sub(
        r"(<!-- tables:begin -->\n).*(<!-- tables:end -->)",
        lambda m: m.group(1) + body + "\n" + m.group(2),
        text,
        flags=re.S,
    )
    doc.write_text(new)
    print(_summary(results))


if __name__ == "__main__":
    main()
