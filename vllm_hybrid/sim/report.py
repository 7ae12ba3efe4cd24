"""Tables (text and markdown), JSON and the PNG plot of simulation results."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vllm_hybrid.sim.replay import RunStats
from vllm_hybrid.sim.runner import Results

BASELINES = ("vllm", "lru-dense", "sglang", "sglang-2pool", "marconi")
GB = 1e9


def headroom_closed(row: dict[str, RunStats], ours: str = "flop") -> float | None:
    """(ours - best baseline) / (belady - best baseline) in FLOPs saved; None if undefined."""
    base = [row[b].flops_saved_rate for b in BASELINES if b in row]
    if ours not in row or not base or "belady" not in row:
        return None
    best = max(base)
    room = row["belady"].flops_saved_rate - best
    if room <= 1e-12:
        return None
    return (row[ours].flops_saved_rate - best) / room


def _seconds(x: float) -> str:
    """Three significant digits, at least one decimal: 0.0123, 4.56, 789.0, 12345.0."""
    return f"{x:.3g}" if x < 100 else f"{x:.1f}"


def _row_cells(name: str, s: RunStats, host: bool = False) -> list[str]:
    cells = [
        name,
        f"{100 * s.token_hit_rate:.1f}%",
        f"{100 * s.flops_saved_rate:.1f}%",
        f"{100 * s.state_hit_rate:.1f}%",
        f"{s.snapshots_taken}/{s.snapshots_kept}",
        f"{s.evicted_kv_blocks}/{s.evicted_snapshots}",
        f"{s.peak_bytes / GB:.2f}/{s.budget_bytes / GB:.4g}"
        if s.budget_bytes < 1 << 61
        else f"{s.peak_bytes / GB:.0f}/inf",
        f"{_seconds(s.ttft(0.5))}/{_seconds(s.ttft(0.95))}",
    ]
    if host:
        cells.append(f"{s.host_hits}/{s.demoted} ({s.promote_seconds:.1f} s)")
    return cells


HEADER = [
    "policy",
    "token hit",
    "FLOPs saved",
    "state hit",
    "snaps taken/kept",
    "evicted kv/snap",
    "peak/budget GB",
    "TTFT p50/p95 s",
]
HOST_HEADER = "host hits/demoted (transfer)"


def _has_host(res: Results) -> bool:
    return any(s.host_budget_bytes for row in res.rows.values() for s in row.values())


def _header(res: Results) -> list[str]:
    return [*HEADER, HOST_HEADER] if _has_host(res) else HEADER


def _table_rows(res: Results) -> list[tuple[str, list[list[str]], str]]:
    out = []
    host = _has_host(res)
    for budget, row in res.rows.items():
        cells = [_row_cells(n, s, host) for n, s in row.items()]
        cells.append(_row_cells("infinite", res.infinite, host))
        closed = headroom_closed(row)
        best = max((row[b].flops_saved_rate for b in BASELINES if b in row), default=0.0)
        note = f"budget {budget / GB:g} GB"
        host_gb = max((s.host_budget_bytes for s in row.values()), default=0) / GB
        if host_gb:
            note += f" + host tier {host_gb:g} GB (references without)"
        if "flop" in row and best > 0:
            note += f"; flop / best baseline = {row['flop'].flops_saved_rate / best:.2f}x"
        if closed is not None:
            note += f"; headroom to Belady closed: {100 * closed:.0f}%"
        if budget in res.marconi_alpha:
            note += f"; marconi alpha = {res.marconi_alpha[budget]:g}"
        out.append((note, cells, ""))
    return out


def format_text(res: Results) -> str:
    lines = [
        f"== {res.workload} | {res.shape} | {res.block_tokens}-token blocks | "
        f"prefill {res.throughput_flops / 1e12:g} TFLOP/s (TTFT, FIFO) =="
    ]
    header = _header(res)
    for note, cells, _ in _table_rows(res):
        widths = [max(len(r[i]) for r in [header, *cells]) for i in range(len(header))]
        lines.append(note)
        for r in [header, *cells]:
            lines.append(
                "  ".join(
                    c.rjust(w) if i else c.ljust(w)
                    for i, (c, w) in enumerate(zip(r, widths, strict=True))
                )
            )
        lines.append("")
    return "\n".join(lines)


def format_markdown(res: Results) -> str:
    lines = [
        f"#### {res.workload}, {res.shape}, {res.block_tokens}-token blocks, "
        f"prefill {res.throughput_flops / 1e12:g} TFLOP/s",
        "",
    ]
    header = _header(res)
    for note, cells, _ in _table_rows(res):
        lines += [f"*{note}*", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(r) + " |" for r in cells]
        lines.append("")
    return "\n".join(lines)


def to_json(res: Results) -> dict[str, Any]:
    return {
        "workload": res.workload,
        "shape": res.shape,
        "block_tokens": res.block_tokens,
        "throughput_flops": res.throughput_flops,
        "infinite": res.infinite.to_dict(),
        "marconi_alpha": {str(b): a for b, a in res.marconi_alpha.items()},
        "budgets": {
            str(b): {
                "rows": {n: s.to_dict() for n, s in row.items()},
                "headroom_closed": headroom_closed(row),
            }
            for b, row in res.rows.items()
        },
    }


def write_json(res: Results, path: str | Path) -> None:
    Path(path).write_text(json.dumps(to_json(res), indent=2) + "\n")


def write_plot(res: Results, path: str | Path) -> None:
    """Token hit rate and FLOPs saved vs budget per policy; needs matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError("the plot needs matplotlib: pip install matplotlib") from exc
    budgets = sorted(res.rows)
    names = list(res.rows[budgets[0]])
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, attr, title in (
        (axes[0], "token_hit_rate", "token hit rate"),
        (axes[1], "flops_saved_rate", "prefill FLOPs saved"),
    ):
        for n in names:
            ys = [100 * getattr(res.rows[b][n], attr) for b in budgets]
            ax.plot(
                [b / GB for b in budgets],
                ys,
                marker="o",
                label=n,
                linestyle="--" if n == "belady" else "-",
            )
        ax.axhline(100 * getattr(res.infinite, attr), color="gray", linestyle=":", label="infinite")
        ax.set_xscale("log")
        ax.set_xlabel("budget (GB, KV + snapshots)")
        ax.set_ylabel(f"{title} (%)")
        ax.set_title(f"{res.workload} / {res.shape}")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
