"""Fixtures for tests that start vLLM engines (marked ``engine``).

Engines run in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``): on 2 cores that halves their
start-up, and the plugin is loaded in-process by vLLM itself. Tiny models are built once per
session (or reused from ``$VLLM_HYBRID_MODEL_CACHE``).
"""

from __future__ import annotations

import gc
import os
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from vllm_hybrid.testing.fixtures import ENGINE_ENV, ENGINE_KWARGS, model_cache_root

for key, value in {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
    os.environ.setdefault(key, value)

vllm = pytest.importorskip("vllm", reason="the engine tests need the cpu extra")


@pytest.fixture(scope="session")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return model_cache_root(tmp_path_factory.mktemp("models"))


@contextmanager
def engine(model_dir: Any, **kwargs: Any) -> Iterator[Any]:
    """A vLLM ``LLM`` on a tiny model, shut down and freed on exit."""
    llm = vllm.LLM(model=str(model_dir), seed=0, **{**ENGINE_KWARGS, **kwargs})
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def shared_prefix_prompts(seed: int, vocab: int, prefix_tokens: int = 600) -> list[list[int]]:
    """Prompts that share a long prefix, plus a repeat and prompts ending on/off block edges."""
    rng = random.Random(seed)
    draw = lambda n: [rng.randrange(10, vocab) for _ in range(n)]  # noqa: E731
    prefix = draw(prefix_tokens)
    prompts = [prefix + draw(rng.randrange(1, 300)) for _ in range(4)]
    prompts.append(list(prompts[0]))  # an exact repeat
    prompts.append(prefix + draw(768 - prefix_tokens))  # ends exactly on a 128/256 boundary
    prompts.append(prefix + draw(769 - prefix_tokens))  # one past it
    prompts.append(draw(700))  # unrelated
    return prompts


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int = 12) -> list[Any]:
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
