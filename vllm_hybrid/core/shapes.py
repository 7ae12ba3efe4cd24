"""Model shapes: the layer groups of a hybrid model, loaded from the JSON files we ship.

A shape is only what the cost model needs (no weights, no tokenizer). The JSON schema::

    {"name": "zamba2-7b", "source": "...", "_note": "...",
     "layers": [{"kind": "mamba2", "count": 81, "d_model": 3584, ...}, ...]}

``kind`` is a key of :data:`vllm_hybrid.core.layers.LAYER_KINDS`; the other keys are the fields of
that layer group. Keys starting with ``_`` are comments and are ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from functools import cached_property
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_hybrid.core.layers import LAYER_KINDS, LayerGroup


class ShapeError(ValueError):
    """A shape name or file that cannot be turned into a :class:`ModelShape`."""


@dataclass(frozen=True)
class ModelShape:
    """A named model: its layer groups, in no particular order."""

    name: str
    layers: tuple[LayerGroup, ...]
    source: str = ""

    # Cached: policies ask for these on every priority (the dataclass is frozen, the layers
    # immutable; cached_property writes the instance __dict__, which frozen allows).
    @cached_property
    def kv_bytes_per_token(self) -> int:
        return sum(g.kv_bytes_per_token for g in self.layers)

    @cached_property
    def snapshot_bytes(self) -> int:
        """Bytes of one recurrent-state snapshot (every recurrent layer's SSM + conv state)."""
        return sum(g.state_bytes for g in self.layers)

    @cached_property
    def snapshot_bytes_int8(self) -> int:
        """Bytes of one snapshot with int8 SSM states (``CostModel(int8_snapshots=True)``)."""
        return sum(g.state_bytes_int8 for g in self.layers)

    @cached_property
    def linear_flops_per_token(self) -> int:
        return sum(g.linear_flops_per_token for g in self.layers)

    @cached_property
    def pair_flops(self) -> int:
        return sum(g.pair_flops for g in self.layers)


def _layer_from_dict(entry: dict[str, Any], where: str) -> LayerGroup:
    kind = entry.get("kind")
    cls = LAYER_KINDS.get(str(kind))
    if cls is None:
        raise ShapeError(f"{where}: unknown layer kind {kind!r}; known: {sorted(LAYER_KINDS)}")
    names = {f.name for f in fields(cls)}
    args = {k: v for k, v in entry.items() if k != "kind" and not k.startswith("_")}
    unknown = set(args) - names
    if unknown:
        raise ShapeError(f"{where}: unknown field(s) {sorted(unknown)} for kind {kind!r}")
    try:
        return cls(**args)
    except TypeError as exc:
        raise ShapeError(f"{where}: {exc}") from exc


def shape_from_dict(data: dict[str, Any], where: str = "shape") -> ModelShape:
    """Build a shape from the JSON schema above; raises :class:`ShapeError` with ``where``."""
    if not isinstance(data.get("name"), str) or not isinstance(data.get("layers"), list):
        raise ShapeError(f"{where}: needs a string 'name' and a list 'layers'")
    layers = tuple(
        _layer_from_dict(e, f"{where}: layers[{i}]") for i, e in enumerate(data["layers"])
    )
    if not layers:
        raise ShapeError(f"{where}: no layers")
    return ModelShape(name=data["name"], layers=layers, source=str(data.get("source", "")))


def builtin_shape_names() -> list[str]:
    """Names of the shapes shipped in ``vllm_hybrid/shapes/``."""
    folder = resources.files("vllm_hybrid").joinpath("shapes")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def load_shape(name_or_path: str) -> ModelShape:
    """Load a shipped shape by name (``zamba2-7b``) or any JSON file by path."""
    path = Path(name_or_path)
    if name_or_path.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ShapeError(f"shape file not found: {name_or_path}")
        text, where = path.read_text(), str(path)
    else:
        names = builtin_shape_names()
        if name_or_path not in names:
            raise ShapeError(f"unknown model shape {name_or_path!r}; known: {', '.join(names)}")
        res = resources.files("vllm_hybrid").joinpath("shapes", f"{name_or_path}.json")
        text, where = res.read_text(), f"shapes/{name_or_path}.json"
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{where}: invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ShapeError(f"{where}: top level must be an object")
    return shape_from_dict(data, where)


#: The shipped shape whose FLOPs stand in for a model of each HF ``model_type`` (``auto``).
SHAPE_BY_MODEL_TYPE = {
    "zamba2": "zamba2-2.7b",
    "nemotron_h": "nemotron-h-8b",
    "granitemoehybrid": "granite-4.0-h-small",
    "falcon_h1": "falcon-h1-7b",
    "jamba": "jamba-1.5-mini",
}
DEFAULT_SHAPE = "zamba2-2.7b"


def shape_name_for_model_type(model_type: str) -> str:
    """The shipped shape for an HF ``model_type``, or :data:`DEFAULT_SHAPE` for others."""
    return SHAPE_BY_MODEL_TYPE.get(model_type, DEFAULT_SHAPE)
