"""Live cluster benchmark (issue 21 parts 3-4): 2 tiny-Zamba2 replicas on a local Ray Serve,
multi-turn chats from concurrent clients (cache_salt tenants included), one cluster per router;
every answer checked against one caching-off single engine on the same prompt tokens.

    nice -n 10 .venv/bin/python benchmarks/cluster_live.py --out out/cluster-live \\
        [--routers state,text-prefix,round-robin] [--chats 8] [--turns 4] [--clients 8] \
        [--systems 2] [--blocks B]

Writes ``results.json`` and ``table.md`` under ``--out``: per router the cluster token hit rate
(cached prompt tokens / prompt tokens, from each answer's ``usage``), later turns that stayed on
their conversation's previous replica, the router's overload decisions, how the turns spread
over the replicas, digest staleness, and whether every answer equals the caching-off engine's
token for token.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from vllm_hybrid.cluster import live


def run_router(model: str, router: str, args: argparse.Namespace) -> tuple[dict, list]:
    start = time.monotonic()
    flags = ["--num-gpu-blocks-override", str(args.blocks)] if args.blocks else []
    with live.local_cluster(model, args.replicas, router, flags) as base:
        up = time.monotonic() - start
        live.wait_digests(base, args.replicas)
        conversations = live.make_conversations(
            args.chats, args.turns, seed=args.seed, shared_systems=args.systems
        )
        t0 = time.monotonic()
        live.run_chats(base, conversations, args.clients, args.max_tokens)
        chat_s = time.monotonic() - t0
        state = live.get_json(f"{base}/v1/hybrid/cluster")
    summary = live.summarize(conversations, state)
    summary.update(router=router, startup_s=up, chat_s=chat_s)
    summary["reasons"] = state.get("counts", {})
    summary["turns"] = [
        [c.index, t.turn, t.replica, t.prompt_tokens, t.cached_tokens]
        for c in conversations
        for t in c.turns
    ]
    summary["outputs"] = {
        f"{c.index}/{t.turn}": list(t.token_ids) for c in conversations for t in c.turns
    }
    return summary, conversations


def fmt(x: Any) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="out/cluster-live")
    parser.add_argument("--routers", default="state,text-prefix,round-robin")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--chats", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--systems", type=int, default=2, help="system prompts the chats share")
    parser.add_argument("--blocks", type=int, help="KV pool blocks per replica (default: vLLM's)")
    parser.add_argument("--model", default=None, help="default: the tiny Zamba2 (built)")
    args = parser.parse_args()
    routers = args.routers.split(",")
    from vllm_hybrid.cluster.app import check_cluster_options

    for router in routers:
        check_cluster_options(args.replicas, router)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.model is None:
        from vllm_hybrid.testing.fixtures import model_cache_root, tiny_model_dir

        args.model = str(tiny_model_dir("zamba2", model_cache_root("models")))
    results: dict[str, Any] = {"args": vars(args)}
    turns: dict[str, list] = {}
    for router in routers:
        results[router], conversations = run_router(args.model, router, args)
        turns[router] = [t for c in conversations for t in c.turns]
        (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    from vllm_hybrid.testing.oracle import caching_off_outputs

    prompts = sorted({t.prompt_ids for ts in turns.values() for t in ts})
    t0 = time.monotonic()
    expected = dict(
        zip(prompts, caching_off_outputs(args.model, prompts, args.max_tokens), strict=True)
    )
    results["oracle_s"] = time.monotonic() - t0
    rows = [
        "| router | hit rate | cached / prompt tokens | later turns on their previous replica "
        "| overloads | turns per replica | outputs == caching off | digest age p50 / max (s) "
        "| chat wall (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    ok = True
    for router in routers:
        r = results[router]
        later = r["later_turns_followed"] + len(r["later_turns_moved"])
        mismatched = [
            f"{t.conversation}/{t.turn}"
            for t in turns[router]
            if t.status != 200 or expected.get(t.prompt_ids) != t.token_ids
        ]
        r["mismatched"] = mismatched
        r["outputs_equal_off"] = not mismatched
        ok &= not mismatched
        age = r.get("digest_age_s") or {}
        rows.append(
            f"| {router} | {r['hit_rate']:.3f} | {r['cached_tokens']} / {r['prompt_tokens']} "
            f"| {r['later_turns_followed']} / {later} | {len(r['overloads'])} "
            f"| {sorted(r['per_replica'].values())} "
            f"| {'yes' if not mismatched else 'NO: ' + ', '.join(mismatched)} "
            f"| {fmt(age.get('p50'))} / {fmt(age.get('max'))} | {r['chat_s']:.1f} |"
        )
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "table.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
