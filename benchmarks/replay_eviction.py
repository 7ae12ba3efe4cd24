"""Side by side: vLLM's own eviction (align mode, LRU) vs the core's policies in the engine.

Replays a seeded workload from ``vllm_hybrid.sim.generators`` (segments materialized into token
ids: token k of segment s is the same wherever s appears) against an in-process vLLM engine on a
tiny random-weight Zamba2 with a KV pool small enough to force eviction, in arrival order, in
batches of ``--batch`` concurrent requests. Prints the token hit rate (sum of each request's
``num_cached_tokens`` / prompt tokens) and the prefill tokens computed, per policy.

    .venv/bin/python benchmarks/replay_eviction.py --gen chat --requests 120 --blocks 96

Rows: ``stock`` is vLLM's own cache (prefix caching on, align mode, LRU eviction; our plugin's
settings say ``policy: stock``); any other name is our scheduler with that policy; ``stock-big`` is stock with a
pool 16x larger (a bound for this workload, not a policy).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vllm_hybrid.sim.generators import GENERATORS  # noqa: E402
from vllm_hybrid.sim.trace import SimRequest  # noqa: E402
from vllm_hybrid.testing.fixtures import ENGINE_KWARGS, tiny_model_dir  # noqa: E402

VOCAB = 1000


def materialize(req: SimRequest, scale: float) -> list[int]:
    """The prompt's token ids: each segment scaled by ``scale``, seeded by its content id."""
    out: list[int] = []
    budget = max(1, round(req.prompt_tokens * scale))
    for content_id, n in req.segments:
        rng = random.Random(content_id)
        out += [rng.randrange(10, VOCAB) for _ in range(max(1, round(n * scale)))]
        if len(out) >= budget:
            break
    return out[:budget]


def workload(gen: str, n: int, scale: float, max_len: int, seed: int) -> list[list[int]]:
    reqs = GENERATORS[gen](seed=seed)
    prompts = [materialize(r, scale) for r in reqs]
    return [p for p in prompts if len(p) <= max_len][:n]


def run(name: str, model_dir: Path, prompts: list[list[int]], args: Any) -> dict[str, Any]:
    import vllm

    blocks = args.blocks * (16 if name == "stock-big" else 1)
    kwargs = {**ENGINE_KWARGS, "max_model_len": args.max_len, "max_num_seqs": args.batch}
    policy = "stock" if name.startswith("stock") else name
    kwargs["additional_config"] = {"vllm_hybrid": {"policy": policy}}
    llm = vllm.LLM(
        model=str(model_dir),
        seed=0,
        enable_prefix_caching=True,
        num_gpu_blocks_override=blocks,
        **kwargs,
    )
    params = vllm.SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    start, cached, outs = time.perf_counter(), 0, []
    for i in range(0, len(prompts), args.batch):
        batch = [{"prompt_token_ids": p} for p in prompts[i : i + args.batch]]
        got = llm.generate(batch, params, use_tqdm=False)
        cached += sum(o.num_cached_tokens for o in got)
        outs += [list(o.outputs[0].token_ids) for o in got]
    wall = time.perf_counter() - start
    pool = llm.llm_engine.engine_core.engine_core.scheduler.kv_cache_manager.block_pool
    evicted = getattr(pool, "hy_policy_pages", None)
    fallback = getattr(pool, "hy_fallback_pages", None)
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    total = sum(len(p) for p in prompts)
    return {
        "policy": name,
        "blocks": blocks,
        "hit_rate": cached / total,
        "computed": total - cached,
        "wall_s": wall,
        "policy_evicted": "-" if evicted is None else evicted,
        "fallback": "-" if fallback is None else fallback,
        "outputs": outs,
    }


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--gen", default="chat", choices=sorted(GENERATORS))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--scale", type=float, default=0.25, help="segment length multiplier")
    ap.add_argument("--blocks", type=int, default=64, help="KV pool blocks (128 tokens each)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--policies", default="stock,vllm,sglang,marconi,flop,stock-big")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--model-root", default=os.environ.get("VLLM_HYBRID_MODEL_CACHE", "out/models"))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one row, print JSON
    return ap.parse_args()


def one_row(name: str) -> dict[str, Any]:
    """Run a row in a fresh process: engines left in one process slow each other down."""
    argv = [a for a in sys.argv[1:]]
    proc = subprocess.run(
        [sys.executable, __file__, *argv, "--one", name], capture_output=True, text=True
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"row {name} failed:\n{proc.stderr[-3000:]}")
    row: dict[str, Any] = json.loads(lines[-1][4:])
    return row


def main() -> None:
    args = parse()
    prompts = workload(args.gen, args.requests, args.scale, args.max_len - args.max_tokens, 0)
    model_dir = tiny_model_dir("zamba2", args.model_root)
    if args.one:
        print("ROW " + json.dumps(run(args.one, model_dir, prompts, args)), flush=True)
        return
    rows = [one_row(p) for p in args.policies.split(",")]
    total = sum(len(p) for p in prompts)
    print(
        f"\n{args.gen}: {len(prompts)} requests, {total} prompt tokens, tiny zamba2, "
        f"batch {args.batch}"
    )
    print(
        f"{'policy':<10} {'blocks':>6} {'hit rate':>9} {'computed':>9} {'evicted':>8} "
        f"{'fallback':>8} {'wall s':>7}"
    )
    for r in rows:
        print(
            f"{r['policy']:<10} {r['blocks']:>6} {r['hit_rate']:>9.3f} {r['computed']:>9} "
            f"{r['policy_evicted']!s:>8} {r['fallback']!s:>8} {r['wall_s']:>7.1f}"
        )
    same = all(r["outputs"] == rows[0]["outputs"] for r in rows)
    print(f"greedy outputs identical across rows: {same}")


if __name__ == "__main__":
    main()
