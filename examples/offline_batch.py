"""Offline batch inference with prefix caching on a hybrid model.

    python examples/offline_batch.py [MODEL_DIR]

Without MODEL_DIR a tiny random-weight Zamba2 is built under ./models. The batch shares a long
system prompt; the second pass is served mostly from cache, and the outputs are the same.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU backend

SYSTEM = "You answer questions about the solar system in one short sentence. " * 20
QUESTIONS = ["How many moons has Mars?", "Which planet is largest?", "What is a comet?"]


def main(model_dir: str | None = None) -> list[list[int]]:
    from vllm import LLM, SamplingParams

    if model_dir is None:
        from vllm_hybrid.testing.make_model import build_model

        model_dir = str(build_model("zamba2", Path("models") / "tiny-zamba2"))
    llm = LLM(
        model=model_dir,
        enable_prefix_caching=True,
        dtype="float32",
        enforce_eager=True,
        max_model_len=4096,
        seed=0,
    )
    prompts = [f"{SYSTEM}\nQuestion: {q}\nAnswer:" for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=16)
    outputs_by_pass = []
    for name in ("first pass", "second pass"):
        outputs = llm.generate(prompts, params, use_tqdm=False)
        for out in outputs:
            print(
                f"{name}: {len(out.prompt_token_ids)} prompt tokens, "
                f"{out.num_cached_tokens} from cache -> {out.outputs[0].text!r}"
            )
        outputs_by_pass.append([list(o.outputs[0].token_ids) for o in outputs])
    assert outputs_by_pass[0] == outputs_by_pass[1], "caching changed the outputs"
    return outputs_by_pass[1]


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
