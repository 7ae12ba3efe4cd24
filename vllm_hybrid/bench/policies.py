"""What each policy row means for the engine: prefix caching on/off, scheduler, settings.

``stock`` is vLLM's own prefix caching (align mode, LRU eviction), ``off`` is prefix caching
disabled, ``ours`` is :class:`~vllm_hybrid.adapters.vllm.scheduler.HybridScheduler` with the
default policy, and any name of ``core.policies.POLICIES`` is HybridScheduler with that policy.
The policy reaches the engine as ``additional_config={"vllm_hybrid": {"policy": NAME}}``; the
plugin selects HybridScheduler by itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_hybrid.bench import BenchError
from vllm_hybrid.core.config import STOCK, HybridCacheConfig
from vllm_hybrid.core.policies import POLICIES

#: The policy the hybrid cache runs when none is configured.
OURS_DEFAULT = HybridCacheConfig.policy
OFF, OURS = "off", "ours"


@dataclass(frozen=True)
class EngineSetup:
    """Engine keyword arguments for one policy row."""

    policy: str
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def known_policies() -> list[str]:
    return [STOCK, OURS, OFF, *POLICIES]


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names, checked; BenchError names the valid ones."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise BenchError("--policies is empty")
    bad = [n for n in names if n not in known_policies()]
    if bad:
        raise BenchError(f"unknown policy {bad[0]!r}; known: {', '.join(known_policies())}")
    if len(set(names)) != len(names):
        raise BenchError(f"--policies lists a name twice: {text!r}")
    return names


def engine_setup(name: str) -> EngineSetup:
    """The engine settings that make row ``name`` (a name accepted by :func:`parse_policies`)."""
    policy = STOCK if name in (STOCK, OFF) else OURS_DEFAULT if name == OURS else name
    kwargs: dict[str, Any] = {
        "enable_prefix_caching": name != OFF,
        "additional_config": {"vllm_hybrid": {"policy": policy}},
    }
    return EngineSetup(name, kwargs)
