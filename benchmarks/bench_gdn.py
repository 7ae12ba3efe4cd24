"""CPU gated delta rule (Qwen3-Next / Qwen3.5 GDN layers): our C++ op and its pure-torch twin
(float32, sequential, exact under any chunking) against vLLM 0.32's own CPU op (bfloat16,
chunked), on one prefill sequence resuming from a state.

Shape: one GDN layer of Qwen3-Next, from transformers' ``Qwen3NextConfig()`` defaults (read at
run time: linear_num_key_heads, linear_num_value_heads, linear_key_head_dim,
linear_value_head_dim). Only the rule is timed (gates, conv and projections are not), each call
from the same initial state in a pool slot, as the engine calls it. Rows, median over repeats:

  vllm-bf16     ops.chunk_gated_delta_rule_cpu (what vLLM's cpu_gdn_attention_core calls for a
                prefill): bf16 q/k/v/beta/state, fp32 g, as the engine hands them to it
  ours-op       vllm_hybrid.ops.gdn.gated_delta_rule (csrc/cpu/gdn.cpp), all fp32
  ours-ref      gated_delta_rule_ref (a Python loop over tokens): timed on the first
                --ref-tokens tokens and scaled to T (its cost is linear in T), states always
"states" = the final state written back to the pool (output_final_state), "no states" = outputs
only. Rows are timed round-robin; ms = median over rounds, ratio = median over rounds of
ours-op / vllm-bf16 in the same round. "err" = max |o - o_ours-op| / max |o_ours-op| of vLLM's
bf16 outputs.

Run:  .venv/bin/python benchmarks/bench_gdn.py [--tokens 512,2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_timing import median_ratio, medians, round_robin, thread_counts, timed  # noqa: E402


def shape() -> tuple[int, int, int, int]:
    from transformers import Qwen3NextConfig

    c = Qwen3NextConfig()
    return (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    )


def inputs(tokens: int, hk: int, hv: int, dk: int, dv: int) -> dict[str, torch.Tensor]:
    from vllm_hybrid.ops.gdn import gdn_gating_ref

    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    A_log = torch.empty(hv).uniform_(1, 16, generator=gen).log()  # Qwen3-Next's A init
    g, beta = gdn_gating_ref(A_log, rand(tokens, hv), rand(tokens, hv), torch.ones(hv))
    return {
        "q": rand(tokens, hk, dk),
        "k": rand(tokens, hk, dk),
        "v": rand(tokens, hv, dv),
        "g": g,
        "beta": beta,
        "state": rand(4, hv, dk, dv) * 0.1,  # a pool of 4 slots; the sequence uses slot 2
    }


def run(tokens: int, repeats: int, ref_tokens: int) -> dict[str, float]:
    import vllm._custom_ops as vllm_ops

    from vllm_hybrid.ops.gdn import gated_delta_rule, gated_delta_rule_ref

    hk, hv, dk, dv = shape()
    t = inputs(tokens, hk, hv, dk, dv)
    cu = torch.tensor([0, tokens], dtype=torch.int32)
    slot = torch.tensor([2], dtype=torch.int32)
    bf = {n: t[n].bfloat16()[None] for n in ("q", "k", "v", "beta")}
    g1 = t["g"][None]
    vstate = t["state"].bfloat16()
    pool = t["state"].clone()
    out = torch.empty(tokens, hv, dv)

    fresh = {"f32": pool, "bf16": vstate}  # a copy of the initial pool per "states" call

    def vllm(final: bool) -> torch.Tensor:
        work = fresh["bf16"] if final else vstate
        o, _ = vllm_ops.chunk_gated_delta_rule_cpu(
            bf["q"], bf["k"], bf["v"], g1, bf["beta"], work, final, cu, False, True, slot
        )
        return o

    def ours(final: bool) -> torch.Tensor:
        work = fresh["f32"] if final else pool
        return gated_delta_rule(
            t["q"],
            t["k"],
            t["v"],
            t["g"],
            t["beta"],
            work,
            cu_seqlens=cu,
            state_indices=slot,
            output_final_state=final,
            out=out,
        )

    def ref() -> None:
        n = min(ref_tokens, tokens)
        s = t["state"][2].clone()
        gated_delta_rule_ref(t["q"][:n], t["k"][:n], t["v"][:n], t["g"][:n], t["beta"][:n], s)

    rows: dict[str, Callable[[], object]] = {
        "vllm_states": lambda: vllm(True),
        "vllm_nostates": lambda: vllm(False),
        "ours_states": lambda: ours(True),
        "ours_nostates": lambda: ours(False),
    }
    rounds = round_robin(rows, repeats, lambda: fresh.update(f32=pool.clone(), bf16=vstate.clone()))
    row = medians(rounds)
    for kind in ("states", "nostates"):
        row[f"ratio_{kind}"] = median_ratio(rounds, f"ours_{kind}", f"vllm_{kind}")
    n = min(ref_tokens, tokens)
    row["ref"] = statistics.median(timed(ref) for _ in range(max(1, repeats // 2))) * tokens / n
    o_ours = ours(False).clone()
    o_vllm = vllm(False)[0].float()
    row["err"] = ((o_vllm - o_ours).abs().max() / o_ours.abs().max()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ref-tokens", type=int, default=32)
    parser.add_argument("--threads", default=None, help="comma list (default: 1,all)")
    args = parser.parse_args()
    hk, hv, dk, dv = shape()
    print(
        f"Qwen3NextConfig(): {hk} key heads, {hv} value heads, K={dk}, V={dv}; "
        f"load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}"
    )
    head = (
        f"{'threads':>7} {'T':>5} | {'vllm-bf16 ms':>12} {'ours-op ms':>10} {'ratio':>6} |"
        f" {'vllm-bf16 ms':>12} {'ours-op ms':>10} {'ratio':>6} | {'ours-ref ms':>11}"
        f" {'ref/op':>7} | {'err':>8}"
    )
    print(f"{'':>13} | {'states':^31} | {'no states':^31} |")
    print(head)
    for n in thread_counts(args.threads):
        for tokens in (int(x) for x in args.tokens.split(",")):
            r = run(tokens, args.repeats, args.ref_tokens)
            print(
                f"{n:>7} {tokens:>5} | {r['vllm_states']:>12.1f} {r['ours_states']:>10.1f}"
                f" {r['ratio_states']:>6.2f} | {r['vllm_nostates']:>12.1f}"
                f" {r['ours_nostates']:>10.1f} {r['ratio_nostates']:>6.2f} |"
                f" {r['ref']:>11.0f} {r['ref'] / r['ours_states']:>7.0f} | {r['err']:>8.1e}",
                flush=True,
            )
    print("ratio = ours-op / vllm-bf16 (below 1: ours faster); ref/op = ours-ref / ours-op")


if __name__ == "__main__":
    main()
