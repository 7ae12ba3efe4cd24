"""GPU half of benchmarks/gpu_check.sh: the snapshot bandwidth table on the current GPU.

Same rows and shape as bench_snapshot.py (Zamba2-7B's 81 Mamba2 layers, 152.2 MB per snapshot),
with the device as the pool and pinned host memory as the tier; "memcpy" is a device-to-device
copy of the same bytes (the device bandwidth bound), and the two pinned memcpy rows are the
host link's bound for the "pool -> tier" rows. Two batch sizes: a typical save (2 pairs) and a
large batch (8 pairs).
"""

from __future__ import annotations

import torch
from bench_snapshot import print_table, run


def main() -> None:
    assert torch.cuda.is_available(), "gpu_check.py needs a GPU"
    print(f"GPU: {torch.cuda.get_device_name()}")
    for pairs in (2, 8):
        print_table(run(81, pairs, repeats=5, device="cuda"), 81, pairs)
        print()


if __name__ == "__main__":
    main()
