"""Tables, JSON and the PNG plot of cluster simulation rows (``sim/cluster.py``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_hybrid.sim.cluster import ClusterStats

HEADER = [
    "N",
    "policy",
    "router",
    "token hit",
    "FLOPs saved",
    "TTFT p50 s",
    "TTFT p95 s",
    "imbalance",
    "overload",
]


def cells(s: ClusterStats) -> list[str]:
    return [
        str(s.replicas),
        s.policy,
        s.router,
        f"{100 * s.token_hit_rate:.1f}%",
        f"{100 * s.flops_saved_rate:.1f}%",
        f"{s.ttft(0.5):.3f}",
        f"{s.ttft(0.95):.3f}",
        f"{s.imbalance:.2f}",
        str(s.decisions.get("overload", "")) if s.decisions else "",
    ]


def format_table(rows: Sequence[ClusterStats], markdown: bool = False) -> str:
    table = [HEADER, *(cells(s) for s in rows)]
    if markdown:
        lines = ["| " + " | ".join(r) + " |" for r in table]
        lines.insert(1, "|" + "---|" * len(HEADER))
        return "\n".join(lines)
    widths = [max(len(r[i]) for r in table) for i in range(len(HEADER))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in table)


def write_json(rows: Sequence[ClusterStats], path: str | Path, **meta: Any) -> None:
    out = {**meta, "rows": [s.to_dict() for s in rows]}
    Path(path).write_text(json.dumps(out, indent=1))


def write_plot(rows: Sequence[ClusterStats], path: str | Path, title: str = "") -> None:
    """FLOPs saved and TTFT p50 against N, one line per (router, policy)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:  # pragma: no cover - matplotlib is in the dev extra
        raise RuntimeError("--plot needs matplotlib (pip install 'vllm-hybrid[dev]')") from exc
    lines: dict[tuple[str, str], list[ClusterStats]] = {}
    for s in rows:
        lines.setdefault((s.router, s.policy), []).append(s)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    routers = sorted({router for router, _ in lines})
    colors = {r: plt.get_cmap("tab10")(i % 10) for i, r in enumerate(routers)}  # one per router
    for (router, policy), pts in sorted(lines.items()):
        pts = sorted(pts, key=lambda s: s.replicas)
        xs = [s.replicas for s in pts]
        style = "-" if policy == "flop" else "--"
        ax1.plot(
            xs,
            [100 * s.flops_saved_rate for s in pts],
            style,
            color=colors[router],
            marker="o",
            label=f"{router} ({policy})",
        )
        ax2.plot(xs, [s.ttft(0.5) for s in pts], style, color=colors[router], marker="o")
    for ax, label in ((ax1, "FLOPs saved (%)"), (ax2, "TTFT p50 (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("replicas")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    ax2.set_yscale("log")
    ax1.legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
