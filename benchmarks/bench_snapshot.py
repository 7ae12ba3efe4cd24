"""Snapshot save / restore throughput: the fused ops vs torch loops vs a plain copy of the bytes.

Shape (Zamba2-7B's Mamba2 layers, as vLLM stores them): 81 recurrent layers, each with
  conv state (3, 7424) bf16, stored token-major and viewed (7424, 3)  [conv dim = d_inner 7168
      + 2 groups * d_state 64; width 4 keeps width - 1 = 3 columns]
  SSM state (112, 64, 64) fp32  [112 heads of head_dim 64, d_state 64]
in one page per block, padded to a multiple of 64 KiB (vLLM pads every hybrid page to one size).
One snapshot = 81 * (44,544 + 1,835,008) B = 152.2 MB. --layers scales it down.

Rows (GB/s = snapshot bytes moved / time; ratio = GB/s / memcpy GB/s):
  memcpy          one contiguous tensor of the same bytes, dst.copy_(src) (the bandwidth bound)
Rows are timed round-robin (each round calls every row once); GB/s is the median over rounds
and "x memcpy" the median over rounds of the ratio to that round's memcpy time, so a busy
machine slows a row and its reference alike.
  fused           snapshot_copy: all layers and pairs in one call
  index_copy loop per tensor dst.index_copy_(0, d, src.index_select(0, s)) (snapshot_copy_ref)
  copy_ loop      per pair and tensor dst[d].copy_(src[s]) (what a per-layer loop does)
  int8 save/restore  snapshot_quantize_int8 / snapshot_dequantize_int8 (bytes of the fp state)
for a save within one pool ("pool -> pool") and from the pool to a separate snapshot pool
("pool -> tier"; on CUDA the tier is pinned host memory, read and written by the kernel).

Run:  .venv/bin/python benchmarks/bench_snapshot.py [--layers 81] [--pairs 4] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

from vllm_hybrid.ops import (
    int8_pool_like,
    snapshot_copy,
    snapshot_copy_ref,
    snapshot_dequantize_int8,
    snapshot_quantize_int8,
)

Row = tuple[str, Callable[[], None]]
CONV_DIM, CONV_COLS, HEADS, HEAD_DIM, D_STATE = 7424, 3, 112, 64, 64
PAGE_ALIGN = 64 << 10


def make_pool(layers: int, blocks: int, device: str, pin: bool = False) -> list[torch.Tensor]:
    """[conv_0, ssm_0, conv_1, ...] as views into padded per-layer pages."""
    conv_bytes = CONV_DIM * CONV_COLS * 2
    ssm_off = -(-conv_bytes // 256) * 256
    ssm_bytes = HEADS * HEAD_DIM * D_STATE * 4
    page_bytes = -(-(ssm_off + ssm_bytes) // PAGE_ALIGN) * PAGE_ALIGN
    states = []
    for _ in range(layers):
        page = torch.empty(blocks, page_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        conv = page[:, :conv_bytes].view(torch.bfloat16).view(blocks, CONV_COLS, CONV_DIM)
        ssm = page[:, ssm_off : ssm_off + ssm_bytes].view(torch.float32)
        ssm = ssm.view(blocks, HEADS, HEAD_DIM, D_STATE)
        conv.normal_()
        ssm.normal_()
        states += [conv.transpose(1, 2), ssm]
    return states


def snapshot_bytes(states: list[torch.Tensor]) -> int:
    return sum(t[0].numel() * t.element_size() for t in states)


def time_rounds(rows: list[Row], repeats: int, device: str) -> dict[str, list[float]]:
    """Seconds per call of every row, measured round-robin (one call of each row per round) so
    that a noisy machine slows all rows of a round alike."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {row[0]: [] for row in rows}
    for _, fn in rows:  # warm-up
        fn()
    for _ in range(repeats):
        for key, fn in rows:
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[key].append(time.perf_counter() - start)
    return times


def copy_loop(src: list[torch.Tensor], dst: list[torch.Tensor], pairs: torch.Tensor) -> None:
    for s, d in pairs.tolist():
        for a, b in zip(src, dst, strict=True):
            b[d].copy_(a[s])


def rows_for(src, dst, pairs, scenario: str, int8: bool) -> list[Row]:
    rows = [
        (f"fused|{scenario}", lambda: snapshot_copy(src, dst, pairs)),
        (f"index_copy loop|{scenario}", lambda: snapshot_copy_ref(src, dst, pairs)),
        (f"copy_ loop|{scenario}", lambda: copy_loop(src, dst, pairs)),
    ]
    if int8:
        q, s = int8_pool_like(src, int(pairs[:, 1].max()) + 1, device=src[0].device)
        restore = pairs.flip(1)
        rows += [
            (f"int8 save|{scenario}", lambda: snapshot_quantize_int8(src, q, s, pairs)),
            (f"int8 restore|{scenario}", lambda: snapshot_dequantize_int8(q, s, dst, restore)),
        ]
    return rows


def run(layers: int, num_pairs: int, repeats: int, device: str) -> list[tuple[str, float, float]]:
    """(row, GB/s median, median over rounds of the ratio to that round's memcpy)."""
    blocks = 2 * num_pairs
    pool = make_pool(layers, blocks, device)
    tier = make_pool(layers, blocks, "cpu", pin=device == "cuda")
    pairs = torch.stack([torch.arange(num_pairs), torch.arange(num_pairs) + num_pairs], 1)
    moved = snapshot_bytes(pool) * num_pairs
    big_src = torch.empty(moved, dtype=torch.uint8, device=device).random_()
    big_dst = torch.empty_like(big_src)
    rows: list[Row] = [("memcpy|-", lambda: big_dst.copy_(big_src))]
    rows += rows_for(pool, pool, pairs, "pool -> pool", int8=True)
    rows += rows_for(pool, tier, pairs, "pool -> tier", int8=False)
    if device == "cuda":  # the host link: plain pinned copies of the same bytes
        host = torch.empty(moved, dtype=torch.uint8, pin_memory=True)
        rows += [
            ("memcpy D2H (pinned)|-", lambda: host.copy_(big_src, non_blocking=True)),
            ("memcpy H2D (pinned)|-", lambda: big_dst.copy_(host, non_blocking=True)),
        ]
    times = time_rounds(rows, repeats, device)
    base = times["memcpy|-"]
    return [
        (
            key,
            moved / statistics.median(t),
            statistics.median(b / x for b, x in zip(base, t, strict=True)),
        )
        for key, t in times.items()
    ]


def print_table(results: list[tuple[str, float, float]], layers: int, num_pairs: int) -> None:
    mb = snapshot_bytes(make_pool(layers, 1, "cpu")) / 1e6
    print(
        f"{layers} layers, {mb:.1f} MB per snapshot, {num_pairs} pairs per call, "
        f"{torch.get_num_threads()} CPU threads"
    )
    print(f"| {'op':<20} | {'scenario':<13} | {'GB/s':>7} | {'x memcpy':>8} |")
    print(f"|{'-' * 22}|{'-' * 15}|{'-' * 9}|{'-' * 10}|")
    for key, rate, ratio in results:
        name, scenario = key.split("|")
        print(f"| {name:<20} | {scenario:<13} | {rate / 1e9:7.2f} | {ratio:8.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=81)
    parser.add_argument("--pairs", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    print_table(run(args.layers, args.pairs, args.repeats, args.device), args.layers, args.pairs)


if __name__ == "__main__":
    main()
