"""What each policy row means for the engine: prefix caching on/off, scheduler, settings.

``stock`` is vLLM's own prefix caching (align mode, LRU eviction), ``off`` is prefix caching
disabled, ``ours`` is :class:`~vllm_hybrid.adapters.vllm.scheduler.HybridScheduler` with the
default policy, and any name of ``core.policies.POLICIES`` is HybridScheduler with that policy.
The policy reaches the engine as ``additional_config={"vllm_hybrid": {"policy": NAME}}``; the
plugin selects HybridScheduler by itself. ``NAME+host`` (e.g. ``ours+host``) is the same row
with the host tier for snapshots on (``host_tier_gb``, the size given by ``--host-gb``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.bench import BenchError
from vllm_hybrid.core import POLICIES, STOCK, HybridCacheConfig

#: The policy the hybrid cache runs when none is configured.
OURS_DEFAULT = HybridCacheConfig.policy
OFF, OURS = "off", "ours"
#: Row-name suffix: the row's policy with the host tier on (docs/host_tier.md).
HOST = "+host"


@dataclass(frozen=True)
class EngineSetup:
    """Engine keyword arguments for one policy row."""

    policy: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def known_policies() -> list[str]:
    return [STOCK, OURS, OFF, *POLICIES]


def base_policy(name: str) -> str:
    """The row's policy without the ``+host`` suffix."""
    return name[: -len(HOST)] if name.endswith(HOST) else name


def _known(name: str) -> bool:
    base = base_policy(name)
    return base in known_policies() and not (name.endswith(HOST) and base in (STOCK, OFF))


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names, checked; BenchError names the valid ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError("--policies is empty")
    bad = [n for n in names if not _known(n)]
    if bad:
        raise BenchError(
            f"unknown policy {bad[0]!r}; known: {', '.join(known_policies())}, "
            f"and any but stock/off with {HOST} (the host tier on)"
        )
    if len(set(names)) != len(names):
        raise BenchError(f"--policies lists a name twice: {text!r}")
    return names


def engine_setup(name: str, host_gb: float = 0.0) -> EngineSetup:
    """The engine settings that make row ``name`` (a name accepted by :func:`parse_policies`);
    ``host_gb``: the host tier's size for a ``+host`` row (must be > 0 there)."""
    base = base_policy(name)
    policy = STOCK if base in (STOCK, OFF) else OURS_DEFAULT if base == OURS else base
    settings: dict[str, Any] = {"policy": policy}
    if name.endswith(HOST):
        if not host_gb > 0:
            raise BenchError(f"row {name!r} needs --host-gb > 0 (the host tier's size in GB)")
        settings["host_tier_gb"] = host_gb
    kwargs: dict[str, Any] = {
        "enable_prefix_caching": name != OFF,
        "additional_config": {"vllm_hybrid": settings},
    }
    return EngineSetup(name, kwargs)
