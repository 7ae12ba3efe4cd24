"""The prefix index (one structure for the engine and the simulator); see ``prefix_index.py``."""

from vllm_hybrid.core.index._base import IsFree, PageKey, VictimStats
from vllm_hybrid.core.index.prefix_index import PrefixIndex
from vllm_hybrid.core.index.trie import HiddenFn, ProbeFn

__all__ = ["HiddenFn", "IsFree", "PageKey", "PrefixIndex", "ProbeFn", "VictimStats"]
