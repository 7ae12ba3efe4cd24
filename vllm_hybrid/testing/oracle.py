"""The caching-off single engine that live cluster runs are checked against: the same prompts
(token ids, as a replica rendered them) through one in-process ``vllm.LLM`` with prefix caching
off, greedy, at the tiny models' engine settings (``fixtures.ENGINE_KWARGS``)."""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from typing import Any

from vllm_hybrid.testing.fixtures import ENGINE_ENV, ENGINE_KWARGS


def caching_off_outputs(
    model_dir: str | os.PathLike[str], prompts: Sequence[Sequence[int]], max_tokens: int
) -> list[tuple[int, ...]]:
    """Greedy output token ids of each prompt (``ignore_eos``, ``max_tokens`` each)."""
    for key, value in {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(key, value)
    import vllm

    llm: Any = vllm.LLM(model=str(model_dir), seed=0, enable_prefix_caching=False, **ENGINE_KWARGS)
    try:
        params = vllm.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False
        )
        return [tuple(o.outputs[0].token_ids) for o in outs]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
