"""The local tokenizer: deterministic, round-trips text, renders the chat template."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from vllm_hybrid.testing import tiny_model_dir
from vllm_hybrid.testing.archs import TINY_VOCAB_SIZE
from vllm_hybrid.testing.tokenizer import BOS_ID, EOS_ID, PAD_ID, make_corpus, train_tokenizer


@pytest.fixture(scope="module")
def tokenizer(model_root: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(tiny_model_dir("granitemoehybrid", model_root))


def test_corpus_is_deterministic() -> None:
    assert make_corpus(0, 50) == make_corpus(0, 50)
    assert make_corpus(0, 50) != make_corpus(1, 50)


def test_size_and_special_ids(tokenizer: PreTrainedTokenizerBase, model_root: Path) -> None:
    assert len(tokenizer) == TINY_VOCAB_SIZE
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id) == (PAD_ID, BOS_ID)
    assert tokenizer.eos_token_id == EOS_ID == tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = json.loads(
        (tiny_model_dir("granitemoehybrid", model_root) / "config.json").read_text()
    )
    assert config["vocab_size"] >= len(tokenizer)
    assert config["eos_token_id"] == tokenizer.eos_token_id


@pytest.mark.parametrize(
    "text",
    [
        "The cache is a prefix of the state.",
        "  Mixed CASE, digits 0123456789 and tabs\tand\nnewlines!",
        "Unicode: café, naïve, 日本語, emoji 🙂.",
    ],
)
def test_round_trip(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text, add_special_tokens=True).input_ids
    assert tokenizer.decode(ids) == text
    assert len(ids) < len(text.encode())  # BPE merges actually compress


def test_common_words_are_single_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    assert len(tokenizer(" the").input_ids) == 1
    assert len(tokenizer(" model").input_ids) == 1


def test_chat_template(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there"},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    plain = tokenizer.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith(plain) and not plain.endswith("assistant\n")
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        }
    ]
    assert "Hi there<|im_end|>" in tokenizer.apply_chat_template(parts, tokenize=False)


def test_chat_turn_markers_are_single_tokens(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "x"}], tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert EOS_ID in ids


def test_train_tokenizer_returns_fresh_objects() -> None:
    first = train_tokenizer(TINY_VOCAB_SIZE)
    first.chat_template = "changed"
    assert train_tokenizer(TINY_VOCAB_SIZE).chat_template != "changed"
