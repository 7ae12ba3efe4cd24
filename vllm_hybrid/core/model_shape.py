"""A model shape (the layer groups the cost model needs) and its JSON schema::

    {"name": "zamba2-7b", "source": "...",
     "layers": [{"kind": "mamba2", "count": 81, "d_model": 3584, ...}, ...]}

``kind`` is a key of :data:`vllm_hybrid.core.layers.LAYER_KINDS`; the other keys are the fields of
that layer group. Keys starting with ``_`` are comments and are ignored. Resolving a name, a file
or a ``model_type`` to a shape is ``shapes.py``; building one from an HF ``config.json`` is
``shape_config.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from functools import cached_property
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

    def to_dict(self) -> dict[str, Any]:
        """The JSON schema above (what :func:`shape_from_dict` reads back)."""
        kinds = {cls: kind for kind, cls in LAYER_KINDS.items()}
        layers = [{"kind": kinds[type(g)], **asdict(g)} for g in self.layers]
        return {"name": self.name, "source": self.source, "layers": layers}


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
