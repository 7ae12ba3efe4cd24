"""CPU SSD scan: cost of returning per-chunk states, and our kernel vs vLLM's own CPU kernel.

Shape: one Mamba2 layer of the `small` Zamba2 test model (hidden 768, expand 2 -> 24 heads of
64, d_state 64, 1 group, chunk 256). Columns, median over repeats, one thread and all threads:

  vllm        vLLM 0.32's CPU kernel (ops.mamba_chunk_scan_fwd_cpu): final states only
  ours-final  our kernel, final states only
  ours-chunks our kernel returning the state of every logical chunk (+1 checkpoint split)

Run:  .venv/bin/python benchmarks/bench_cpu_scan.py [--tokens 512,2048,8192] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_hybrid.adapters.vllm.cpu_mamba2 import mamba_chunk_scan_combined_fwd_cpu as ours

HEADS, HEAD_DIM, GROUPS, D_STATE, CHUNK = 24, 64, 1, 64, 256


def layout(tokens: int) -> tuple[torch.Tensor, ...]:
    checkpoint = (tokens - 1) // 128 * 128  # vLLM's last-block-boundary checkpoint
    cuts = sorted({c for c in range(CHUNK, tokens, CHUNK)} | {checkpoint} - {0, tokens})
    bounds = torch.tensor([0, *cuts, tokens], dtype=torch.int32)
    owners = torch.zeros(len(bounds) - 1, dtype=torch.int32)
    last = torch.tensor([len(owners) - 1], dtype=torch.int32)
    return torch.tensor([0, tokens], dtype=torch.int32), bounds, owners, last


def inputs(tokens: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "x": torch.randn(tokens, HEADS, HEAD_DIM, generator=g),
        "dt": torch.randn(tokens, HEADS, generator=g),
        "A": -torch.rand(HEADS, generator=g),
        "B": torch.randn(tokens, GROUPS, D_STATE, generator=g),
        "C": torch.randn(tokens, GROUPS, D_STATE, generator=g),
        "D": torch.randn(HEADS, generator=g),
        "dt_bias": torch.randn(HEADS, generator=g),
    }


def median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run(tokens: int, repeats: int) -> tuple[float, float, float]:
    from vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm import (
        _mamba_chunk_scan_combined_fwd_cpu as vllm_scan,
    )

    t = inputs(tokens)
    cu, bounds, owners, last = layout(tokens)
    out = torch.empty_like(t["x"])
    args = (t["x"], t["dt"], t["A"], t["B"], t["C"], CHUNK, out)
    kw = dict(
        D=t["D"],
        dt_bias=t["dt_bias"],
        dt_softplus=True,
        cu_seqlens=cu,
        seq_idx=owners,
        cu_chunk_seqlens=bounds,
        last_chunk_indices=last,
    )
    return (
        median_ms(lambda: vllm_scan(*args, **kw), repeats),
        median_ms(lambda: ours(*args, **kw), repeats),
        median_ms(lambda: ours(*args, return_intermediate_states=True, **kw), repeats),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="512,2048,8192")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{'threads':>7} {'tokens':>7} {'vllm ms':>9} {'ours-final':>11} {'ours-chunks':>12}"
        f" {'chunks/final':>13} {'ours/vllm':>10}"
    )
    for threads in (1, torch.get_num_threads()):
        torch.set_num_threads(threads)
        for tokens in (int(x) for x in args.tokens.split(",")):
            native, final, chunks = run(tokens, args.repeats)
            print(
                f"{threads:>7} {tokens:>7} {native:>9.2f} {final:>11.2f} {chunks:>12.2f}"
                f" {chunks / final:>13.3f} {final / native:>10.2f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
