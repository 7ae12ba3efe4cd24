"""A small byte-level BPE tokenizer, trained offline on a generated English corpus.

The corpus is built from a fixed word list and pseudo-words by a seeded ``random.Random``, so
the tokenizer is the same on every machine. It is wrapped as a
``transformers.PreTrainedTokenizerFast`` with ChatML-style special tokens and a Jinja chat
template (``add_generation_prompt`` supported), so vLLM's chat endpoints work on the models.

Special token ids are fixed: ``<|pad|>`` = 0, ``<|startoftext|>`` (bos) = 1, ``<|im_end|>``
(eos, ends an assistant turn) = 2, ``<|im_start|>`` = 3, ``<|endoftext|>`` = 4.
"""

from __future__ import annotations

import functools
import random
from importlib import resources
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, IM_START, ENDOFTEXT = (
    "<|pad|>",
    "<|startoftext|>",
    "<|im_end|>",
    "<|im_start|>",
    "<|endoftext|>",
)
SPECIAL_TOKENS = [PAD, BOS, EOS, IM_START, ENDOFTEXT]
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2

_WORDS = """
the of and to in is was that for it as with his on be at by had are but from or have an
they which one you were all her she there would their we him been has when who will no more
if out so up said what its about than into them can only other time new some could these two
may first then do any like my now over such our man me even most made after also did many
before must through back years where much your way well down should because each just those
people how too little state good very make world still own see men work long get here between
both life being under never day same another know while last might us great old year off come
since against go came right used take three states himself few house use during without again
place around however home small found thought went say part once general high upon school every
does got united left number course war until always away something fact though water less
public put think almost hand enough far took head yet government system better set told nothing
night end why called didn't eyes find going look asked later knew point next city business give
group toward young let room president side social given present several order national second
possible rather per face among form important often things looked early white case large need
big four within felt children along saw best church ever least power development light thing
seemed family interest want members mind country area others done turned although open problem
sense help cache prefix state model token memory block layer attention mamba recurrent hybrid
request server prompt answer question system user assistant chat turn history engine kernel
""".split()

_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]
_PUNCT = [".", ".", ".", ",", "?", "!", ";", ":"]


def _pseudo_words(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct pronounceable pseudo-words of two to four syllables."""
    words: set[str] = set()
    while len(words) < count:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))))
    return sorted(words)


def _sentence(rng: random.Random, vocab: list[str]) -> str:
    words = [rng.choice(vocab) for _ in range(rng.randint(4, 16))]
    if rng.random() < 0.2:
        words.insert(rng.randrange(len(words)), str(rng.randint(0, 2048)))
    text = " ".join(words)
    return text[0].upper() + text[1:] + rng.choice(_PUNCT)


def make_corpus(seed: int = 0, num_lines: int = 4000) -> list[str]:
    """Deterministic English-like training lines (same ``seed`` -> same lines)."""
    rng = random.Random(seed)
    vocab = _WORDS * 8 + _pseudo_words(rng, 1500)
    lines = []
    for _ in range(num_lines):
        lines.append(" ".join(_sentence(rng, vocab) for _ in range(rng.randint(1, 4))))
    return lines


def chat_template() -> str:
    """The ChatML-like Jinja template shipped next to this module."""
    return resources.files(__package__).joinpath("chat_template.jinja").read_text()


@functools.lru_cache(maxsize=4)
def _train_bpe_json(vocab_size: int, seed: int) -> str:
    """The trained byte-level BPE, serialised (cached: training takes about a second)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(make_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return str(tok.to_str())


def train_tokenizer(vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE with exactly ``vocab_size`` tokens (specials included), chat-ready."""
    tok = Tokenizer.from_str(_train_bpe_json(vocab_size, seed))
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, ENDOFTEXT],
        model_max_length=8192,
    )
    wrapped.chat_template = chat_template()
    return wrapped


def save_tokenizer(out_dir: Path, vocab_size: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """Train the tokenizer and save it (tokenizer.json, config, chat template) to ``out_dir``."""
    tok = train_tokenizer(vocab_size, seed)
    tok.save_pretrained(out_dir)
    return tok
