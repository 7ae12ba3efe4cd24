"""transformers loads every tiny model and greedy-decodes non-degenerate tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vllm_hybrid.testing import ARCHS, tiny_model_dir
from vllm_hybrid.testing.archs import TINY_VOCAB_SIZE
from vllm_hybrid.testing.make_model import load_transformers_model
from vllm_hybrid.testing.tokenizer import SPECIAL_TOKENS


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_loads_and_generates(arch: str, model_root: Path) -> None:
    model = load_transformers_model(tiny_model_dir(arch, model_root))
    prompt = torch.arange(10, 42)[None]
    with torch.no_grad():
        logits = model(prompt).logits[0]
        out = model.generate(prompt, max_new_tokens=4, do_sample=False)
    greedy = logits.argmax(-1)
    assert greedy.unique().numel() >= len(greedy) // 3, "argmax barely varies across positions"
    assert int(greedy.min()) >= len(SPECIAL_TOKENS) and int(greedy.max()) < TINY_VOCAB_SIZE
    top2 = logits.topk(2, dim=-1).values
    assert float((top2[:, 0] - top2[:, 1]).median()) > 0.1, "greedy choices are near-ties"
    assert out.shape == (1, prompt.shape[1] + 4)
    assert torch.equal(out[0, prompt.shape[1]], greedy[-1])


def test_output_depends_on_context(model_root: Path) -> None:
    """The mixers matter: the same last token after different prefixes predicts differently."""
    model = load_transformers_model(tiny_model_dir("granitemoehybrid", model_root))
    prompts = torch.randint(5, TINY_VOCAB_SIZE, (4, 24), generator=torch.Generator().manual_seed(0))
    prompts[:, -1] = 100
    with torch.no_grad():
        greedy = model(prompts).logits[:, -1].argmax(-1)
    assert greedy.unique().numel() >= 3
