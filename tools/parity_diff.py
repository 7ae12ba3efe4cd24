"""Engine against simulator, request by request, with vLLM's real scheduler and no model.

``bench replay``'s ``sim hit`` column is one number; this tool says where the two part. It runs
vLLM 0.32.0's scheduler over a fake model (``vllm_hybrid/testing/parity.py``) with the token ids
a ``bench replay --max-num-seqs 1 --time-scale 0`` row served (warm-up, reset, then every
request waiting from the start), and the simulator's prediction for the same row
(``bench/predict.py``, one request in flight with its running pages, as the ``sim hit`` column
of such a row). It prints the hit rates, every request whose hits differ, and for the first
``--show`` of them the pages each pool evicted while serving it and the request before.

    python tools/parity_diff.py --trace gen:agent --requests 80 --blocks 64 \\
        --engine-json out/parity/agent.json

``--engine-json`` (a ``bench replay --json`` file with a row of ``--policy``) gives the engine's
output token ids (the fake model's samples, so answer blocks hash as in the engine), its pool
layout and its hits (a third column: where the harness differs from it, the harness is not the
engine). Blocks are named by where they first appear: ``r12b3g0`` is request 12's block 3 in
group 0 (attention; the simulator's state group is g1, vLLM's Mamba groups g1..g6).
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "out/models/zamba2-small-s0"))
    p.add_argument("--trace", default="gen:agent")
    p.add_argument("--requests", type=int, default=80)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--scale", type=float, default=0.25)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--policy", default="stock")
    p.add_argument("--engine-json", default=None)
    p.add_argument("--match-unit", type=int, default=None, help="the simulator's (ours: 1)")
    p.add_argument("--show", type=int, default=1, help="differing requests to detail")
    p.add_argument("--all", action="store_true", help="print every request")
    return p.parse_args(argv)


def load_requests(args: argparse.Namespace) -> list[Any]:
    from vllm_hybrid.bench.workload import build_workload, iter_source

    source = itertools.islice(iter_source(args.trace, 0), args.skip, None)
    return build_workload(source, args.requests, args.scale, args.max_len, args.max_tokens)


def run_simulator(
    args: argparse.Namespace, reqs: list[Any], layout: Any
) -> tuple[float | None, list[int], list[tuple[int, Hashable, int]]]:
    """The prediction, each request's hit and the pool's evictions (clock, key, group)."""
    import vllm_hybrid.sim.pool as sim_pool
    from vllm_hybrid.bench import predict

    hits: list[int] = []
    log: list[tuple[int, Hashable, int]] = []
    drop = sim_pool.SimPool._drop

    def dropped(self: Any, page: int) -> None:
        key, group = self._page_of[page]
        log.append((self.now, key, group))
        drop(self, page)

    sim_pool.SimPool._drop = dropped  # type: ignore[method-assign]
    try:
        waiting = [len(reqs) - 1 - i for i in range(len(reqs))]
        rate = predict.predict_hit_rate(
            reqs, layout, args.policy, 1, args.warmup, waiting, hits, args.match_unit
        )
    finally:
        sim_pool.SimPool._drop = drop  # type: ignore[method-assign]
    return rate, hits, [e for e in log if e[0] >= args.warmup]


def sim_block_names(reqs: list[Any], block_tokens: int) -> dict[Hashable, str]:
    from vllm_hybrid.bench.predict import sim_requests
    from vllm_hybrid.sim.trace import KeyedRequest

    names: dict[Hashable, str] = {}
    for r, sr in zip(reqs, sim_requests(reqs, block_tokens), strict=True):
        kr = KeyedRequest(sr, block_tokens)
        for k, key in enumerate(kr.keys):
            names.setdefault(key, f"r{r.index}b{k}")
        if kr.tail_key is not None:
            names.setdefault(kr.tail_key, f"r{r.index}t")
    return names


def engine_block_names(h: Any, reqs: list[Any], block_tokens: int) -> dict[Any, str]:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    names: dict[Any, str] = {}
    groups = len(h.sched.kv_cache_config.kv_cache_groups)
    step = block_tokens // h.hash_block_size
    for r in reqs:
        for i, bh in enumerate(h.requests[str(r.index)].block_hashes):
            tokens = (i + 1) * h.hash_block_size
            label = f"r{r.index}@{tokens}"
            if (i + 1) % step == 0:
                label = f"r{r.index}b{tokens // block_tokens - 1}"
            for g in range(groups):
                names.setdefault(make_block_hash_with_group_id(bh, g), f"{label}g{g}")
    return names


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    from vllm_hybrid.bench.predict import PoolLayout
    from vllm_hybrid.testing.parity import EngineShape, engine_hits, run_replay

    reqs = load_requests(args)
    shape = EngineShape(blocks=args.blocks, max_len=args.max_len)
    engine: dict[int, int] = {}
    outputs: dict[int, Sequence[int]] = {}
    layout = PoolLayout(args.blocks, shape.block_tokens, 1 << 20, 1, shape.mamba_groups, "zamba2")
    if args.engine_json:
        data = json.loads(Path(args.engine_json).read_text())
        rows = {r["policy"]: r for r in data["rows"]}
        row = rows.get(args.policy) or rows["ours"]  # ours: the default policy's row
        for rec in row["records"]:
            engine[rec["index"]] = rec["cached_tokens"]
            outputs[rec["index"]] = rec["output_token_ids"]
        layout = PoolLayout.from_json(row["layout"])
    h = run_replay(args.model, reqs, shape, policy=args.policy, warmup=args.warmup, outputs=outputs)
    harness = engine_hits(h, reqs)
    rate, sim, sim_log = run_simulator(args, reqs, layout)
    prompt = sum(r.prompt_tokens for r in reqs)
    line = f"harness hit {sum(harness) / prompt:.3f}  sim hit {rate:.3f}"
    if engine:
        line += f"  engine hit {sum(engine.values()) / prompt:.3f}"
    print(line)
    sim_names = sim_block_names(reqs, shape.block_tokens)
    eng_names = engine_block_names(h, reqs, shape.block_tokens)
    shown = 0
    for i, r in enumerate(reqs):
        e, s, eng = harness[i], sim[i], engine.get(r.index)
        differs = e != s or (eng is not None and eng != e)
        if args.all or differs:
            print(
                f"r{r.index:<3} prompt {r.prompt_tokens:5} harness {e:5} sim {s:5}"
                + ("" if eng is None else f" engine {eng:5}")
                + ("  <-" if differs else "")
            )
        if differs and shown < args.show:
            shown += 1
            ids = {str(r.index), str(reqs[i - 1].index) if i else None}
            ev = [eng_names.get(x, "?") for who, x in h.log if who in ids]
            sv = [
                sim_names.get(key, repr(key)[:16]) + f"g{group}"
                for t, key, group in sim_log
                if t - args.warmup in (i - 1, i)
            ]
            print(f"   vLLM evicted (this request and the one before): {ev}")
            print(f"   sim evicted  (this request and the one before): {sv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
