"""Typed reading of an HF ``config.json`` dict for :mod:`vllm_hybrid.core.shape_config`.

A missing, mistyped or unknown value is a :class:`~vllm_hybrid.core.shapes.ShapeError` that
names the key, so a user knows what to add to the config.
"""

from __future__ import annotations

from typing import Any

from vllm_hybrid.core.layers import AttentionLayers, LayerGroup, Mamba2Layers
from vllm_hybrid.core.model_shape import ShapeError

Config = dict[str, Any]
_DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "float16": 2, "bf16": 2, "fp16": 2}


class ConfigReader:
    """Typed access to one config dict; a missing or mistyped key is a :class:`ShapeError`."""

    def __init__(self, cfg: Config, where: str) -> None:
        self.cfg = cfg
        self.where = where

    def num(self, key: str, default: int | None = None) -> int:
        value = self.cfg.get(key, default)
        if value is None:
            raise ShapeError(
                f"{self.where}: config has no {key!r} (model_type "
                f"{self.cfg.get('model_type')!r}); add it to the config.json"
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ShapeError(f"{self.where}: {key!r} must be a non-negative integer, got {value!r}")
        return value

    def opt_num(self, key: str, default: int = 0) -> int:
        return default if self.cfg.get(key) is None else self.num(key)

    def seq(self, key: str) -> list[Any] | None:
        value = self.cfg.get(key)
        if value is None:
            return None
        if not isinstance(value, list):
            raise ShapeError(f"{self.where}: {key!r} must be a list, got {type(value).__name__}")
        return value

    def dtype_bytes(self, key: str, default: int) -> int:
        value = self.cfg.get(key)
        if value in (None, "auto"):
            return default
        if value not in _DTYPE_BYTES:
            raise ShapeError(f"{self.where}: unknown dtype {value!r} for {key!r}")
        return _DTYPE_BYTES[value]


def layout(r: ConfigReader, key: str, aliases: dict[str, str]) -> list[str]:
    """The per-layer kinds of list ``key``, each mapped through ``aliases``."""
    raw = r.seq(key)
    if raw is None:
        raise ShapeError(f"{r.where}: config has no {key!r} list of layer kinds")
    n = r.opt_num("num_hidden_layers", len(raw))
    if len(raw) != n:
        raise ShapeError(f"{r.where}: {key!r} has {len(raw)} entries, num_hidden_layers is {n}")
    out = []
    for i, kind in enumerate(raw):
        if kind not in aliases:
            raise ShapeError(
                f"{r.where}: {key}[{i}] is {kind!r}; known: {', '.join(sorted(aliases))}"
            )
        out.append(aliases[kind])
    return out


def attention(
    r: ConfigReader, count: int, d_in: int | None = None, **extra: Any
) -> AttentionLayers:
    d_model = r.num("hidden_size")
    heads = r.num("num_attention_heads")
    head_dim = r.opt_num("head_dim", 0) or r.opt_num("attention_head_dim", 0) or d_model // heads
    return AttentionLayers(
        count=count,
        n_heads=heads,
        n_kv_heads=r.opt_num("num_key_value_heads", heads),
        head_dim=head_dim,
        d_in=d_in or d_model,
        d_out=d_model,
        **extra,
    )


def mamba2(r: ConfigReader, count: int, n_heads: int, head_dim: int, **keys: str) -> Mamba2Layers:
    return Mamba2Layers(
        count=count,
        d_model=r.num("hidden_size"),
        d_inner=n_heads * head_dim,
        d_state=r.num(keys["d_state"]),
        n_groups=r.num(keys["n_groups"], 1),
        n_heads=n_heads,
        conv_kernel=r.num(keys["conv"], 4),
        state_dtype_bytes=2,
    )


def keep(groups: list[LayerGroup]) -> list[LayerGroup]:
    return [g for g in groups if g.count > 0]
