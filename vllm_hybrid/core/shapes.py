"""Model shapes: the layer groups of a hybrid model, loaded from the JSON files we ship.

A shape is only what the cost model needs (no weights, no tokenizer). The JSON schema::

    {"name": "zamba2-7b", "source": "...",
     "layers": [{"kind": "mamba2", "count": 81, "d_model": 3584, ...}, ...]}

``kind`` is a key of :data:`vllm_hybrid.core.layers.LAYER_KINDS`; the other keys are the fields of
that layer group. Keys starting with ``_`` are comments and are ignored. The shipped files are
generated from the checkpoints' ``config.json`` by ``tools/gen_shapes.py`` through
:func:`vllm_hybrid.core.shape_config.shape_from_hf_config`.

:func:`load_shape` resolves a name the way ``vllm-hybrid simulate --model`` takes it: a shipped
shape name, a path to a shape JSON or to an HF ``config.json``, or an HF ``model_type`` whose
``transformers`` config-class defaults (dumped to ``shapes/_model_type_defaults.json`` by the
generator, so no ``transformers`` is needed here) describe the family's flagship checkpoint;
a ``model_type`` whose defaults are no real checkpoint (``lfm2``, ``nemotron_h``, ...) names
the shipped shape of its flagship (:data:`SHAPE_BY_MODEL_TYPE`).
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from vllm_hybrid.core.model_shape import ModelShape, ShapeError, shape_from_dict
from vllm_hybrid.core.shape_config import shape_from_hf_config

__all__ = [
    "ModelShape",
    "ShapeError",
    "builtin_shape_names",
    "load_shape",
    "shape_from_dict",
    "shape_name_for_model_type",
]


#: Generated file holding each known ``model_type``'s config-class defaults.
MODEL_TYPE_DEFAULTS = "_model_type_defaults.json"


def builtin_shape_names() -> list[str]:
    """Names of the shapes shipped in ``vllm_hybrid/shapes/`` (files starting ``_`` are data)."""
    folder = resources.files("vllm_hybrid").joinpath("shapes")
    return sorted(
        p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json") and p.name[0] != "_"
    )


def model_type_defaults() -> dict[str, dict[str, Any]]:
    """``model_type`` -> its ``transformers`` config-class defaults as a config.json dict."""
    res = resources.files("vllm_hybrid").joinpath("shapes", MODEL_TYPE_DEFAULTS)
    if not res.is_file():
        return {}
    data = json.loads(res.read_text())
    return {k: v for k, v in data.items() if not k.startswith("_") and isinstance(v, dict)}


def _read_json(text: str, where: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ShapeError(f"{where}: invalid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ShapeError(f"{where}: top level must be an object")
    return data


def _from_any_dict(data: dict[str, Any], name: str, where: str, source: str) -> ModelShape:
    # A shape JSON has "layers"; an HF config.json has "model_type" instead.
    if "layers" not in data and "model_type" in data:
        return shape_from_hf_config(data, name=name, source=source, where=where)
    return shape_from_dict(data, where)


def load_shape(name_or_path: str) -> ModelShape:
    """Load a shipped shape by name (``zamba2-7b``), a shape JSON or HF ``config.json`` by
    path, or an HF ``model_type`` (``qwen3_next``) from its config-class defaults."""
    path = Path(name_or_path)
    if name_or_path.endswith(".json") or path.is_file():
        if not path.is_file():
            raise ShapeError(f"shape file not found: {name_or_path}")
        data = _read_json(path.read_text(), str(path))
        stem = path.parent.name if path.name == "config.json" else path.stem
        return _from_any_dict(data, stem or path.name, str(path), f"{path} (config.json)")
    names = builtin_shape_names()
    if name_or_path in names:
        res = resources.files("vllm_hybrid").joinpath("shapes", f"{name_or_path}.json")
        where = f"shapes/{name_or_path}.json"
        return shape_from_dict(_read_json(res.read_text(), where), where)
    defaults = model_type_defaults()
    if name_or_path in defaults:
        return _from_any_dict(
            defaults[name_or_path],
            name_or_path,
            f"{MODEL_TYPE_DEFAULTS}[{name_or_path!r}]",
            f"transformers config-class defaults of model_type {name_or_path!r}",
        )
    if name_or_path in SHAPE_BY_MODEL_TYPE:  # defaults that are no checkpoint: the flagship's
        return load_shape(SHAPE_BY_MODEL_TYPE[name_or_path])
    types = ", ".join(sorted(set(defaults) | set(SHAPE_BY_MODEL_TYPE)))
    raise ShapeError(
        f"unknown model shape {name_or_path!r}; known: {', '.join(names)}; or a model_type "
        f"({types}); or a path to a shape JSON or an HF config.json "
        "(tools/gen_shapes.py --dump-config MODEL_TYPE writes one from transformers)"
    )


#: The shipped shape whose FLOPs stand in for a model of each HF ``model_type`` (``auto``).
SHAPE_BY_MODEL_TYPE = {
    "zamba2": "zamba2-2.7b",
    "nemotron_h": "nemotron-h-8b",
    "granitemoehybrid": "granite-4.0-h-small",
    "falcon_h1": "falcon-h1-7b",
    "jamba": "jamba-1.5-mini",
    "qwen3_next": "qwen3-next-80b-a3b",
    "qwen3_5": "qwen3.5-9b",
    "qwen3_5_text": "qwen3.5-9b",
    "qwen3_5_moe": "qwen3.5-35b-a3b",
    "qwen3_5_moe_text": "qwen3.5-35b-a3b",
    "lfm2": "lfm2-1.2b",
    "lfm2_moe": "lfm2-8b-a1b",
    "olmo_hybrid": "olmo-hybrid-7b",
    "kimi_linear": "kimi-linear-48b-a3b",
}
DEFAULT_SHAPE = "zamba2-2.7b"


def shape_name_for_model_type(model_type: str) -> str:
    """The shipped shape for an HF ``model_type``, or :data:`DEFAULT_SHAPE` for others."""
    return SHAPE_BY_MODEL_TYPE.get(model_type, DEFAULT_SHAPE)
