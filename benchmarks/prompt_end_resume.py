"""Where a next turn resumes when its prompt does not repeat the answer as generated.

One offline engine (the tiny Zamba2 of ``vllm_hybrid.testing``, fp32, 128-token blocks, a
128-block pool, our defaults with ``debug`` checks). Per case: a prompt of ``P`` random token
ids with 8 greedy tokens, then a next turn = the prompt + the first ``d`` generated tokens + 40
new tokens (``d`` < 7: the turn diverges inside the answer, as a chat template that re-renders
the answer, or drops its reasoning, makes it; ``d`` = 7: it repeats all that was computed).
Prints the cached tokens of the next turn, where it could resume at best (``P + d``, capped by
the states an engine can hold: ``P`` when ``d`` < 7) and whether its greedy output equals the
same request under a fresh ``cache_salt`` (computed from scratch)::

    .venv/bin/python benchmarks/prompt_end_resume.py
"""

from __future__ import annotations

import os
import random
import uuid

from vllm_hybrid.testing.fixtures import (
    ENGINE_ENV,
    ENGINE_KWARGS,
    model_cache_root,
    tiny_model_dir,
)

CASES = ((564, 2), (689, 0), (611, 5), (700, 7))
ANSWER = 8


def main() -> int:
    for key, value in {**ENGINE_ENV, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}.items():
        os.environ.setdefault(key, value)
    import vllm

    model = tiny_model_dir("zamba2", model_cache_root("models"))
    llm = vllm.LLM(
        model=str(model),
        seed=0,
        **{
            **ENGINE_KWARGS,
            "enable_prefix_caching": True,
            "num_gpu_blocks_override": 128,
            "additional_config": {"vllm_hybrid": {"debug": True}},
        },
    )
    params = vllm.SamplingParams(temperature=0.0, max_tokens=ANSWER, ignore_eos=True)

    def generate(prompt: list[int], salt: str | None = None):  # type: ignore[no-untyped-def]
        item: dict = {"prompt_token_ids": prompt}
        if salt is not None:
            item["cache_salt"] = salt
        return llm.generate([item], params, use_tqdm=False)[0]

    rng = random.Random(5)
    print("| prompt P | answer tokens shared d | next turn cached | best | output == scratch |")
    print("|---|---|---|---|---|")
    ok = True
    for prompt_tokens, shared in CASES:
        prompt = [rng.randrange(10, 1000) for _ in range(prompt_tokens)]
        answer = list(generate(prompt).outputs[0].token_ids)
        turn = prompt + answer[:shared] + [rng.randrange(10, 1000) for _ in range(40)]
        got = generate(turn)
        fresh = generate(turn, salt=uuid.uuid4().hex)
        same = list(got.outputs[0].token_ids) == list(fresh.outputs[0].token_ids)
        best = prompt_tokens + shared if shared == ANSWER - 1 else prompt_tokens
        ok &= same
        print(f"| {prompt_tokens} | {shared} | {got.num_cached_tokens} | {best} | {same} |")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
