"""Transitional name: the engine adapter's import of the one index (``core/index/``)."""

from vllm_hybrid.core.index import PrefixIndex as PoolMirror
from vllm_hybrid.core.index import VictimStats

__all__ = ["PoolMirror", "VictimStats"]
