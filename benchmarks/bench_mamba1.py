"""CPU Mamba1 selective scan (Jamba's SSM layers): our C++ op ``selective_scan_fwd`` (float32,
sequential, exact under any chunking) against the only other CPU path there is,
transformers' pure-torch ``mamba_selective_scan`` (its sequential branch, what
``JambaMambaMixer`` runs without mamba_ssm); vLLM 0.32's CPU build has no ``selective_scan_fwd``.
One prefill sequence, no initial state.

Shape: one Mamba1 layer from transformers' ``JambaConfig()`` defaults (read at run time:
hidden_size * mamba_expand channels, mamba_d_state), one group. Rows, median over repeats:

  hf-seq      transformers' mamba_selective_scan (sequential torch loop over tokens), with the
              final state returned ("states": return_last_state) or not ("no states")
  ours-op     vllm_hybrid.ops.mamba1.selective_scan (csrc/cpu/selective_scan.cpp): it always
              writes the final state into its pool slot (vLLM's contract), so one row
Rows are timed round-robin; ratio = median over rounds of ours-op / hf-seq in the same round.
"err" = max |y - y_ours| / max |y_ours| of transformers' outputs.

Run:  .venv/bin/python benchmarks/bench_mamba1.py [--tokens 512,2048] [--repeats 3]
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
    from transformers import JambaConfig

    c = JambaConfig()
    return c.hidden_size * c.mamba_expand, c.mamba_d_state


def run(tokens: int, repeats: int) -> dict[str, float]:
    from transformers.models.jamba import modeling_jamba as jamba

    from vllm_hybrid.ops.mamba1 import selective_scan

    channels, n = shape()
    gen = torch.Generator().manual_seed(0)
    rand = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u, delta, z = rand(channels, tokens), rand(channels, tokens) - 2.0, rand(channels, tokens)
    A = -torch.arange(1, n + 1, dtype=torch.float32).repeat(channels, 1)  # Jamba's A init
    B, C = rand(1, n, tokens), rand(1, n, tokens)
    D, bias = torch.ones(channels), rand(channels) * 0.1
    hf_scan = getattr(jamba.mamba_selective_scan, "__wrapped__", jamba.mamba_selective_scan)
    pool = torch.zeros(2, channels, n)
    starts = torch.tensor([0, tokens], dtype=torch.int32)
    out: dict[str, torch.Tensor] = {}

    def ours() -> None:
        d, zz = delta.clone(), z.clone()  # the op writes y and the gated output in place
        selective_scan(
            u, d, A, B, C, D, zz, bias, True, starts, torch.tensor([1], dtype=torch.int32),
            None, pool, -1,
        )  # fmt: skip
        out["ours"] = zz

    def hf(final: bool) -> None:
        y = hf_scan(u[None], delta[None], A, B, C, D, z[None], bias, True, return_last_state=final)
        out["hf"] = y[0] if final else y

    rows: dict[str, Callable[[], object]] = {
        "hf_states": lambda: hf(True),
        "hf_nostates": lambda: hf(False),
        "ours": ours,
    }
    rounds = round_robin(rows, repeats)
    row = medians(rounds)
    for kind in ("states", "nostates"):
        row[f"ratio_{kind}"] = median_ratio(rounds, "ours", f"hf_{kind}")
    ours()
    hf(False)
    y_ours, y_hf = out["ours"], out["hf"][0]
    row["err"] = ((y_hf - y_ours).abs().max() / y_ours.abs().max()).item()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", default=None, help="comma list (default: 1,all)")
    args = parser.parse_args()
    channels, n = shape()
    print(
        f"JambaConfig(): {channels} channels, d_state {n}; load average "
        f"{os.getloadavg()[0]:.2f}; torch {torch.__version__}"
    )
    print(
        f"{'threads':>7} {'T':>5} | {'hf-seq ms':>10} {'(no states)':>11} | {'ours-op ms':>10} |"
        f" {'ratio':>6} {'(no states)':>11} | {'err':>8}"
    )
    for t in thread_counts(args.threads):
        for tokens in (int(x) for x in args.tokens.split(",")):
            r = run(tokens, args.repeats)
            print(
                f"{t:>7} {tokens:>5} | {r['hf_states']:>10.1f} {r['hf_nostates']:>11.1f} |"
                f" {r['ours']:>10.1f} | {r['ratio_states']:>6.2f} {r['ratio_nostates']:>11.2f} |"
                f" {r['err']:>8.1e}",
                flush=True,
            )
    print("ratio = ours-op / hf-seq (below 1: ours faster)")


if __name__ == "__main__":
    main()
