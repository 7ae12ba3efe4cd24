"""The plugin makes our schedulers vLLM's default, and leaves an explicit choice alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the cpu extra")

from vllm.config.scheduler import SchedulerConfig  # noqa: E402

from vllm_hybrid.adapters.vllm import scheduler  # noqa: E402
from vllm_hybrid.adapters.vllm.plugin import select_hybrid_scheduler  # noqa: E402


def _resolve(async_scheduling: bool = False) -> type:
    config = SimpleNamespace(scheduler_cls=None, async_scheduling=async_scheduling)
    return SchedulerConfig.get_scheduler_cls(config)  # type: ignore[arg-type]


def test_default_scheduler_is_ours_and_explicit_choices_stay() -> None:
    assert select_hybrid_scheduler()
    assert select_hybrid_scheduler()  # idempotent: wrapped once
    assert getattr(SchedulerConfig.get_scheduler_cls, "_vllm_hybrid", False)
    assert _resolve() is scheduler.HybridScheduler
    assert _resolve(async_scheduling=True) is scheduler.HybridAsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    explicit = SimpleNamespace(scheduler_cls=Scheduler, async_scheduling=False)
    assert SchedulerConfig.get_scheduler_cls(explicit) is Scheduler  # type: ignore[arg-type]


def test_refused_on_another_vllm_version(monkeypatch) -> None:
    from vllm_hybrid.adapters.vllm import plugin

    original = SchedulerConfig.get_scheduler_cls
    monkeypatch.setattr(SchedulerConfig, "get_scheduler_cls", lambda self: None)
    monkeypatch.setattr(plugin, "check_vllm_version", lambda what: False)
    assert not select_hybrid_scheduler()
    assert SchedulerConfig.get_scheduler_cls is not original  # left as it was (the stub)
