"""An agent loop with growing tool output, offline: every step re-sends the whole history.

    python examples/agent_loop.py [MODEL_DIR]

Each step's prompt is the previous prompt + the model's reply + a (fake) tool result, so the
history grows; with prefix caching each step is served from cache up to where the previous
step's prompt ended (block-aligned), and only the new reply and tool output are computed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

SYSTEM = "You are an agent. Call tools with <call>name(args)</call>. " * 12
TOOL_OUTPUT = "result: 17 files match; first lines follow. " * 6


def main(model_dir: str | None = None, steps: int = 4) -> list[tuple[int, int]]:
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
    tokenizer = llm.get_tokenizer()
    history = tokenizer.encode(SYSTEM + "\nTask: find the failing test.\n")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    rows = []
    for step in range(1, steps + 1):
        out = llm.generate([{"prompt_token_ids": history}], params, use_tqdm=False)[0]
        rows.append((len(history), out.num_cached_tokens))
        print(f"step {step}: prompt {len(history)} tokens, {out.num_cached_tokens} from cache")
        history = history + list(out.outputs[0].token_ids)
        history += tokenizer.encode(f"\n<tool step={step}>{TOOL_OUTPUT}</tool>\n")
    return rows


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
