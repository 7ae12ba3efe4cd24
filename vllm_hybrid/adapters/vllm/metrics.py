"""Hybrid-cache statistics on vLLM's stats path (stub: filled in by the metrics work)."""

from __future__ import annotations

from typing import Any


def attach_hybrid_stats(pool: Any, stats: Any) -> None:
    """Add the hybrid pool's counters to one ``SchedulerStats`` (vLLM 0.32.0)."""
    del pool, stats
