"""A tiny attention-only checkpoint (Llama, random weights, the local tokenizer): the control
model for "the plugin stays out of the way" (``tests/engine/test_inert.py``: vLLM's own
scheduler, none of our per-step work). Not one of :data:`~vllm_hybrid.testing.archs.ARCHS`,
which are the hybrids the cache is for.

    from vllm_hybrid.testing.attention_only import tiny_attention_model_dir
    model_dir = tiny_attention_model_dir(tmp_path)   # built once per (root, seed)
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from vllm_hybrid.testing.archs import MAX_POSITION_EMBEDDINGS, TINY_VOCAB_SIZE

#: ``transformers``' ``model_type`` of the control model.
MODEL_TYPE = "llama"
#: Two layers, hidden size 128, attention head size 64 (one the CPU attention backend takes).
TINY_LLAMA: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": MAX_POSITION_EMBEDDINGS,
    "vocab_size": TINY_VOCAB_SIZE,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
RECIPE_VERSION = 1


def _write(tmp: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from vllm_hybrid.testing.tokenizer import SPECIAL_TOKENS, save_tokenizer
    from vllm_hybrid.testing.weights import INIT_STD, shape_output_head

    config = CONFIG_MAPPING[MODEL_TYPE](**TINY_LLAMA, initializer_range=INIT_STD, dtype="float32")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape_output_head(model, TINY_VOCAB_SIZE, range(len(SPECIAL_TOKENS)), seed)
    model.eval().save_pretrained(tmp)
    save_tokenizer(tmp, TINY_VOCAB_SIZE)


def build_attention_model(out_dir: str | os.PathLike[str], seed: int = 0) -> Path:
    """Build (or reuse) the tiny Llama in ``out_dir``; same seed, same weights."""
    from vllm_hybrid.testing.make_model import build_checkpoint

    stamp = {"arch": MODEL_TYPE, "size": "tiny", "seed": seed, "recipe": RECIPE_VERSION}
    return build_checkpoint(out_dir, stamp, lambda tmp: _write(tmp, seed))


def tiny_attention_model_dir(root: str | os.PathLike[str], seed: int = 0) -> Path:
    """Path of the tiny Llama under ``root`` (shared with ``tiny_model_dir``'s models)."""
    return build_attention_model(Path(root) / f"{MODEL_TYPE}-tiny-s{seed}", seed)
