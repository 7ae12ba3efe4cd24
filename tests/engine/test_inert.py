"""The plugin stays out of the way where it cannot help: an attention-only model, or a hybrid
with prefix caching off, runs vLLM's own scheduler class and pool with none of our code in its
steps; on a hybrid with prefix caching, the cache reports' history of prompts exists only once
a request asks for a report."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.sched.scheduler import Scheduler

from tests.engine.conftest import engine, greedy, shared_prefix_prompts, vllm
from tests.engine.test_hybrid_scheduler import scheduler_of
from vllm_hybrid.testing.attention_only import tiny_attention_model_dir
from vllm_hybrid.testing.fixtures import tiny_model_dir

pytestmark = pytest.mark.engine

PACKAGE = str(Path(__file__).resolve().parents[2] / "vllm_hybrid")
REPORT = {"cache_report": True}


class OurCalls:
    """Every Python call into ``vllm_hybrid`` while it is on (all threads), by function."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}

    def __call__(self, frame, event, arg):  # noqa: ANN001, ANN204
        if event == "call" and frame.f_code.co_filename.startswith(PACKAGE):
            name = f"{frame.f_code.co_filename}:{frame.f_code.co_name}"
            self.calls[name] = self.calls.get(name, 0) + 1

    def __enter__(self) -> OurCalls:
        threading.setprofile(self)
        sys.setprofile(self)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)
        threading.setprofile(None)


def generate(llm, prompts, **extra_args):  # noqa: ANN001, ANN201
    """Greedy, 4 tokens, with ``extra_args`` (cache options) when given."""
    if not extra_args:
        return greedy(llm, prompts, max_tokens=4)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=4, extra_args=extra_args)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def test_attention_only_model_runs_vllms_scheduler_and_none_of_our_code(model_root) -> None:
    prompts = shared_prefix_prompts(seed=3, vocab=2048, prefix_tokens=200)
    with engine(tiny_attention_model_dir(model_root), enable_prefix_caching=True) as llm:
        sched = scheduler_of(llm)
        assert type(sched) is Scheduler  # vLLM's own class, not a subclass
        assert type(sched.kv_cache_manager.block_pool) is BlockPool
        with OurCalls() as ours:
            outs = generate(llm, prompts) + generate(llm, prompts[:2], **REPORT)
        assert sum(o.num_cached_tokens for o in outs) > 0  # prefix caching ran
        assert all(not (o.kv_transfer_params or {}).get("vllm_hybrid") for o in outs)
    assert ours.calls == {}, f"our code ran in an attention-only engine: {ours.calls}"


def test_hybrid_without_prefix_caching_runs_vllms_scheduler(model_root) -> None:
    with engine(tiny_model_dir("zamba2", model_root), enable_prefix_caching=False) as llm:
        sched = scheduler_of(llm)
        assert type(sched) is Scheduler
        assert type(sched.kv_cache_manager.block_pool) is BlockPool
        with OurCalls() as ours:
            generate(llm, shared_prefix_prompts(seed=4, vocab=2048)[:3])
    scheduler_steps = {k: v for k, v in ours.calls.items() if "/adapters/vllm/" in k}
    # the CPU scan runs (cpu_mamba2.py: the same arithmetic with caching on or off), no
    # scheduler or pool code of ours
    assert all("cpu_mamba2.py" in k or "/ops/" in k for k in scheduler_steps), scheduler_steps


def test_reuse_history_exists_once_a_request_asks_for_a_report(model_root) -> None:
    prompts = shared_prefix_prompts(seed=5, vocab=2048)
    with engine(tiny_model_dir("zamba2", model_root), enable_prefix_caching=True) as llm:
        control = scheduler_of(llm).hy_control
        assert control is not None
        generate(llm, prompts[:3])
        assert control.history is None  # nobody asked: no prompt kept
        (out,) = generate(llm, prompts[3:4], **REPORT)
        first = out.kv_transfer_params["vllm_hybrid"]["cache_report"]
        assert control.history is not None
        # compared with no earlier prompt (the three before it were not kept): no divergence
        assert first["prompt_tokens"] == len(prompts[3]) and "diverges_at_token" not in first
        (again,) = generate(llm, prompts[4:5], **REPORT)  # shares the 600-token prefix
        assert again.kv_transfer_params["vllm_hybrid"]["cache_report"]["diverges_at_token"] >= 600
