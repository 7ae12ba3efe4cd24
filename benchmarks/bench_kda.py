"""CPU Kimi delta attention (Kimi-Linear's KDA layers): our C++ gated delta rule with a
per-channel decay (float32, sequential, exact under any chunking) against the only other CPU
path there is, transformers' pure-torch chunked ``chunk_kimi_delta_attention`` (vLLM 0.32 has
no CPU KDA kernel: its layer calls FLA's Triton kernels), on one prefill sequence resuming from
a state.

Shape: one KDA layer from transformers' ``KimiLinearConfig()`` defaults (read at run time:
linear_num_heads, linear_head_dim). Only the rule is timed. Rows, median over repeats:

  hf-chunk     transformers' chunk_kimi_delta_attention (its torch fallback, chunk 64, fp32)
  ours-kda     vllm_hybrid.ops.gdn.gated_delta_rule with g of (T, H, K)
  ours-gdn     the same op with one decay per head (g of (T, H)): what the per-channel decay costs
"states" = the final state written back (output_final_state), "no states" = outputs only.
Rows are timed round-robin; ratio = median over rounds of ours-kda / hf-chunk in the same
round. "err" = max |o - o_ours| / max |o_ours| of transformers' chunked outputs.

Run:  .venv/bin/python benchmarks/bench_kda.py [--tokens 512,2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from op_timing import median_ratio, medians, round_robin, thread_counts  # noqa: E402


def shape() -> tuple[int, int]:
    from transformers import KimiLinearConfig

    c = KimiLinearConfig()
    return c.linear_num_heads, c.linear_head_dim


def run(tokens: int, repeats: int) -> dict[str, float]:
    from transformers.models.kimi_linear import modeling_kimi_linear as kimi

    from vllm_hybrid.ops.gdn import gated_delta_rule, kda_gating_ref

    heads, dim = shape()
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    q, k, v = rand(tokens, heads, dim), rand(tokens, heads, dim), rand(tokens, heads, dim)
    A_log = torch.empty(heads).uniform_(1, 16, generator=gen).log()  # transformers' init
    g, beta = kda_gating_ref(
        A_log, rand(tokens, heads * dim), rand(tokens, heads), rand(heads * dim)
    )
    pool = rand(4, heads, dim, dim) * 0.1  # the sequence uses slot 2
    cu, slot = torch.tensor([0, tokens]), torch.tensor([2])
    out = torch.empty(tokens, heads, dim)
    chunked = getattr(
        kimi.chunk_kimi_delta_attention, "__wrapped__", kimi.chunk_kimi_delta_attention
    )
    fresh = {"pool": pool}

    def ours(decay: torch.Tensor, final: bool) -> torch.Tensor:
        work = fresh["pool"] if final else pool
        return gated_delta_rule(
            q, k, v, decay, beta, work, cu_seqlens=cu, state_indices=slot,
            output_final_state=final, out=out,
        )  # fmt: skip

    def hf(final: bool) -> torch.Tensor:
        o, _ = chunked(
            q[None], k[None], v[None], g[None], beta[None], initial_state=pool[2:3].clone(),
            output_final_state=final, use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        return o[0]

    rows: dict[str, Callable[[], object]] = {
        "hf_states": lambda: hf(True),
        "hf_nostates": lambda: hf(False),
        "kda_states": lambda: ours(g, True),
        "kda_nostates": lambda: ours(g, False),
        "gdn_states": lambda: ours(g[:, :, 0], True),
    }
    rounds = round_robin(rows, repeats, lambda: fresh.update(pool=pool.clone()))
    row = medians(rounds)
    for kind in ("states", "nostates"):
        row[f"ratio_{kind}"] = median_ratio(rounds, f"kda_{kind}", f"hf_{kind}")
    o_ours = ours(g, False).clone()
    row["err"] = ((hf(False) - o_ours).abs().max() / o_ours.abs().max()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", default=None, help="comma list (default: 1,all)")
    args = parser.parse_args()
    heads, dim = shape()
    print(
        f"KimiLinearConfig(): {heads} heads, K=V={dim}; load average "
        f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}"
    )
    print(f"{'':>13} | {'states':^30} | {'no states':^30} |")
    print(
        f"{'threads':>7} {'T':>5} | {'hf-chunk ms':>11} {'ours-kda ms':>11} {'ratio':>6} |"
        f" {'hf-chunk ms':>11} {'ours-kda ms':>11} {'ratio':>6} | {'ours-gdn ms':>11} |"
        f" {'err':>8}"
    )
    for n in thread_counts(args.threads):
        for tokens in (int(x) for x in args.tokens.split(",")):
            r = run(tokens, args.repeats)
            print(
                f"{n:>7} {tokens:>5} | {r['hf_states']:>11.1f} {r['kda_states']:>11.1f}"
                f" {r['ratio_states']:>6.2f} | {r['hf_nostates']:>11.1f}"
                f" {r['kda_nostates']:>11.1f} {r['ratio_nostates']:>6.2f} |"
                f" {r['gdn_states']:>11.1f} | {r['err']:>8.1e}",
                flush=True,
            )
    print("ratio = ours-kda / hf-chunk (below 1: ours faster)")


if __name__ == "__main__":
    main()
