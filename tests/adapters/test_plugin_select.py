"""The plugin chooses the scheduler per engine: ours for an attention + Mamba hybrid with prefix
caching, vLLM's own class for anything else; an explicit choice is left alone."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="needs the cpu extra")

import torch  # noqa: E402
from vllm.config.scheduler import SchedulerConfig  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    MambaSpec,
    SlidingWindowSpec,
)

from vllm_hybrid.adapters.vllm import scheduler  # noqa: E402
from vllm_hybrid.adapters.vllm.compat.patches import SchedulerChoice  # noqa: E402
from vllm_hybrid.adapters.vllm.plugin import select_hybrid_scheduler  # noqa: E402
from vllm_hybrid.core.config import ConfigError  # noqa: E402

ATTENTION = FullAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32)
MAMBA = MambaSpec(
    block_size=16,
    shapes=((4, 8),),
    dtypes=(torch.float32,),
    page_size_padded=ATTENTION.page_size_bytes,
    mamba_cache_mode="align",
)
WINDOW = SlidingWindowSpec(
    block_size=16, num_kv_heads=1, head_size=64, dtype=torch.float32, sliding_window=32
)


def _resolve(async_scheduling: bool = False) -> object:
    config = SimpleNamespace(scheduler_cls=None, async_scheduling=async_scheduling)
    return SchedulerConfig.get_scheduler_cls(config)  # type: ignore[arg-type]


def _engine(caching: bool, *specs: object, settings: object = None) -> tuple[object, object]:
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(enable_prefix_caching=caching),
        additional_config={"vllm_hybrid": settings} if settings is not None else {},
    )
    groups = [SimpleNamespace(kv_cache_spec=spec) for spec in specs]
    return vllm_config, SimpleNamespace(kv_cache_groups=groups)


def test_the_chooser_is_installed_once_and_explicit_choices_stay() -> None:
    assert select_hybrid_scheduler()
    assert select_hybrid_scheduler()  # idempotent: wrapped once
    assert getattr(SchedulerConfig.get_scheduler_cls, "_vllm_hybrid", False)
    sync, asynchronous = _resolve(), _resolve(async_scheduling=True)
    assert isinstance(sync, SchedulerChoice) and sync.default is Scheduler
    assert isinstance(asynchronous, SchedulerChoice) and asynchronous.default is AsyncScheduler
    explicit = SimpleNamespace(scheduler_cls=Scheduler, async_scheduling=False)
    assert SchedulerConfig.get_scheduler_cls(explicit) is Scheduler  # type: ignore[arg-type]


def test_ours_only_for_attention_mamba_hybrids_with_prefix_caching() -> None:
    assert select_hybrid_scheduler()
    sync, asynchronous = _resolve(), _resolve(async_scheduling=True)
    assert isinstance(sync, SchedulerChoice) and isinstance(asynchronous, SchedulerChoice)
    hybrid = _engine(True, ATTENTION, MAMBA)
    assert sync.resolve(*hybrid) is scheduler.HybridScheduler
    assert asynchronous.resolve(*hybrid) is scheduler.HybridAsyncScheduler
    assert sync.resolve(*_engine(True, ATTENTION, MAMBA, settings={"policy": "stock"})) is (
        scheduler.HybridScheduler  # vLLM's eviction, our breakpoints and pins
    )
    for other in (
        _engine(False, ATTENTION, MAMBA),  # prefix caching off
        _engine(True, ATTENTION),  # attention only
        _engine(True, MAMBA),  # Mamba only
        _engine(True, ATTENTION, MAMBA, WINDOW),  # another spec next to them
    ):
        assert sync.resolve(*other) is Scheduler
        assert asynchronous.resolve(*other) is AsyncScheduler
    with pytest.raises(ConfigError, match="valid: stock, flop"):
        sync.resolve(*_engine(True, ATTENTION, settings={"policy": "belady-ish"}))


def test_refused_on_another_vllm_version(monkeypatch) -> None:
    from vllm_hybrid.adapters.vllm.compat import patches

    original = SchedulerConfig.get_scheduler_cls
    monkeypatch.setattr(SchedulerConfig, "get_scheduler_cls", lambda self: None)
    monkeypatch.setattr(patches, "check_vllm_version", lambda what: False)
    assert not select_hybrid_scheduler()
    assert SchedulerConfig.get_scheduler_cls is not original  # left as it was (the stub)
