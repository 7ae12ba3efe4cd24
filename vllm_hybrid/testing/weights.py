"""Random weights that give well-separated greedy choices.

With the usual ``initializer_range=0.02`` a tiny random model's logits are all close to zero:
the top two are often within float noise of each other, so two correct engines could disagree
on a greedy token. Here the LM head is redrawn so that logits have a standard deviation of
:data:`LOGIT_STD` (after the final RMS norm the hidden state has unit RMS), and the rows of
special tokens and of ids the tokenizer does not have are shrunk so that greedy decoding never
picks them: generation runs to ``max_tokens`` and never yields an undecodable id.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

#: Standard deviation of every linear and embedding weight at init (``initializer_range``).
INIT_STD = 0.06
#: Standard deviation of the logits of ordinary tokens.
LOGIT_STD = 4.0
#: Factor applied to the LM-head rows of tokens that greedy decoding must never pick.
MUTED_ROW_SCALE = 0.05


def output_head(model: nn.Module) -> nn.Parameter:
    """The ``(vocab, hidden)`` weight of the model's LM head (tied or not)."""
    head = model.get_output_embeddings()
    if head is None or not isinstance(head.weight, nn.Parameter):
        raise ValueError(f"{type(model).__name__} has no output embedding weight")
    return head.weight


@torch.no_grad()
def shape_output_head(
    model: nn.Module, num_tokens: int, muted_ids: Iterable[int], seed: int
) -> None:
    """Redraw the LM head so logits have std :data:`LOGIT_STD`; mute unusable rows.

    Mutates the LM-head weight in place (with tied embeddings, the input embeddings too).
    ``num_tokens`` is the tokenizer's size: rows at or past it are muted, as are ``muted_ids``.
    """
    weight = output_head(model)
    vocab, hidden = weight.shape
    gen = torch.Generator().manual_seed(seed + 1)
    fresh = torch.randn(vocab, hidden, generator=gen, dtype=torch.float32)
    fresh *= LOGIT_STD / math.sqrt(hidden)
    muted = sorted(set(muted_ids) | set(range(num_tokens, vocab)))
    fresh[muted] *= MUTED_ROW_SCALE
    weight.copy_(fresh.to(weight.dtype))
