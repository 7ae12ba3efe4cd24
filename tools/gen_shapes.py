"""Regenerate the shipped model shapes (``vllm_hybrid/shapes/*.json``) from config.json values.

Every shipped shape comes from one HF ``config.json`` dict fed to the core loader
(``vllm_hybrid.core.shape_config.shape_from_hf_config``, reached through ``load_shape``):

* ``PUBLISHED``: the fields the loader reads of a public checkpoint's ``config.json``, written
  here as data (no network where this runs). ``SOURCES`` says where each came from;
  docs/results/2026-12-03-shapes-from-configs.md lists which values are confirmed how.
* ``FROM_DEFAULTS``: checkpoints whose ``transformers`` config-class defaults are the flagship
  (``AutoConfig.for_model(model_type).to_dict()``); those defaults are also dumped to
  ``shapes/_model_type_defaults.json``, so ``simulate --model qwen3_next`` works without
  ``transformers`` installed.
* ``marconi-7b`` is synthetic (the Marconi paper's 7B Attention-Mamba2 hybrid, no checkpoint)
  and is left as written.

    .venv/bin/python tools/gen_shapes.py              # rewrite the JSONs (needs transformers)
    .venv/bin/python tools/gen_shapes.py --check      # exit 1 if a shipped JSON is stale
    .venv/bin/python tools/gen_shapes.py --dump-config qwen3_5 > config.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from vllm_hybrid.core import ModelShape, load_shape  # noqa: E402

SHAPES = ROOT / "vllm_hybrid" / "shapes"
DEFAULTS_FILE = SHAPES / "_model_type_defaults.json"

def _zamba2_7b_blocks() -> list[str]:
    # Zyphra/Zamba2-7B: a shared-attention ("hybrid") layer at 6, 11, then every 6th; 81 layers.
    blocks = ["mamba"] * 6 + ["hybrid"] + ["mamba"] * 4 + ["hybrid"]
    blocks += (["mamba"] * 5 + ["hybrid"]) * 11 + ["mamba"] * 3
    return blocks


_GRANITE_TINY_TYPES = (
    ["mamba"] * 5 + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 9
    + ["attention"] + ["mamba"] * 9 + ["attention"] + ["mamba"] * 4
)
_LFM2_8B_TYPES = [
    "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv",
    "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
    "full_attention", "conv", "conv", "full_attention", "conv", "conv",
]

PUBLISHED: dict[str, dict[str, Any]] = {
    "zamba2-7b": {
        "model_type": "zamba2", "hidden_size": 3584, "num_hidden_layers": 81,
        "layers_block_type": _zamba2_7b_blocks(), "mamba_d_state": 64, "mamba_d_conv": 4,
        "mamba_expand": 2, "mamba_ngroups": 2, "mamba_headdim": 64, "intermediate_size": 14336,
        "num_attention_heads": 32, "num_key_value_heads": 32, "attention_head_dim": 224,
    },
    "falcon-h1-7b": {
        "model_type": "falcon_h1", "hidden_size": 3072, "num_hidden_layers": 44,
        "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
        "intermediate_size": 12288, "mamba_d_state": 256, "mamba_n_groups": 1,
        "mamba_n_heads": 24, "mamba_d_head": 128, "mamba_d_ssm": 3072, "mamba_expand": 2,
        "mamba_d_conv": 4,
    },
    "granite-4.0-h-small": {
        "model_type": "granitemoehybrid", "hidden_size": 4096, "num_hidden_layers": 40,
        "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 72,
        "num_experts_per_tok": 10, "shared_intermediate_size": 1536, "intermediate_size": 768,
        "mamba_d_state": 128, "mamba_d_conv": 4, "mamba_expand": 2,
        # not confirmed: the GraniteMoeHybridConfig defaults (128 x 64 = expand * hidden)
        "mamba_n_heads": 128, "mamba_d_head": 64, "mamba_n_groups": 1,
        # 36 Mamba + 4 attention layers as published; positions as in the tiny model
        "layer_types": _GRANITE_TINY_TYPES,
    },
    "granite-4.0-h-tiny": {
        "model_type": "granitemoehybrid", "hidden_size": 1536, "num_hidden_layers": 40,
        "num_attention_heads": 12, "num_key_value_heads": 4, "intermediate_size": 512,
        "shared_intermediate_size": 1024, "num_local_experts": 64, "num_experts_per_tok": 6,
        "mamba_d_state": 128, "mamba_n_groups": 1, "mamba_n_heads": 48, "mamba_d_head": 64,
        "mamba_expand": 2, "mamba_d_conv": 4, "layer_types": _GRANITE_TINY_TYPES,
    },
    "nemotron-h-8b": {
        "model_type": "nemotron_h", "hidden_size": 4096, "num_hidden_layers": 52,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128,
        "intermediate_size": 21504, "mamba_num_heads": 128, "mamba_head_dim": 64,
        "n_groups": 8, "ssm_state_size": 128, "conv_kernel": 4, "expand": 2,
    },
    "lfm2-1.2b": {
        "model_type": "lfm2", "hidden_size": 2048, "num_hidden_layers": 16,
        "num_attention_heads": 32, "num_key_value_heads": 8, "conv_L_cache": 3,
        "conv_dim": 2048, "full_attn_idxs": [2, 5, 8, 10, 12, 14], "block_ff_dim": 12288,
        "block_auto_adjust_ff_dim": True, "block_ffn_dim_multiplier": 1.0,
        "block_multiple_of": 256,
    },
    "lfm2-8b-a1b": {
        "model_type": "lfm2_moe", "hidden_size": 2048, "num_hidden_layers": 24,
        "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 7168,
        "moe_intermediate_size": 1792, "num_experts": 32, "num_experts_per_tok": 4,
        "num_dense_layers": 2, "conv_L_cache": 3, "layer_types": _LFM2_8B_TYPES,
    },
}

#: Shipped shape -> the model_type whose transformers defaults are that checkpoint.
FROM_DEFAULTS = {
    "zamba2-2.7b": "zamba2",
    "jamba-1.5-mini": "jamba",
    "qwen3-next-80b-a3b": "qwen3_next",
    "qwen3.5-9b": "qwen3_5",
    "qwen3.5-35b-a3b": "qwen3_5_moe",
    "olmo-hybrid-7b": "olmo_hybrid",
    "kimi-linear-48b-a3b": "kimi_linear",
}

SOURCES = {
    "zamba2-7b": "Zyphra/Zamba2-7B config.json (Zyphra key names, mapped)",
    "falcon-h1-7b": "tiiuae/Falcon-H1-7B config.json",
    "granite-4.0-h-small": "ibm-granite/granite-4.0-h-small config.json; Mamba heads from "
    "GraniteMoeHybridConfig defaults",
    "granite-4.0-h-tiny": "ibm-granite/granite-4.0-h-tiny config.json",
    "nemotron-h-8b": "nvidia/Nemotron-H-8B-Base-8K config.json",
    "lfm2-1.2b": "LiquidAI/LFM2-1.2B config.json",
    "lfm2-8b-a1b": "LiquidAI/LFM2-8B-A1B config.json",
    "zamba2-2.7b": "Zyphra/Zamba2-2.7B (= transformers Zamba2Config defaults)",
    "jamba-1.5-mini": "ai21labs/AI21-Jamba-1.5-Mini (= transformers JambaConfig defaults)",
    "qwen3-next-80b-a3b": "Qwen/Qwen3-Next-80B-A3B (= transformers Qwen3NextConfig defaults)",
    "qwen3.5-9b": "Qwen3.5 9B-class dense (= transformers Qwen3_5Config defaults)",
    "qwen3.5-35b-a3b": "Qwen/Qwen3.5-35B-A3B (= transformers Qwen3_5MoeConfig defaults)",
    "olmo-hybrid-7b": "allenai/Olmo-Hybrid-7B (= transformers OlmoHybridConfig defaults)",
    "kimi-linear-48b-a3b": "moonshotai/Kimi-Linear-48B-A3B (= transformers KimiLinearConfig "
    "defaults)",
}


#: model_types whose config-class defaults are dumped for ``load_shape(model_type)``: only
#: those whose defaults are a real checkpoint (the others' model_type names their shipped shape,
#: ``SHAPE_BY_MODEL_TYPE`` in core/shapes.py).
MODEL_TYPES = tuple(sorted(set(FROM_DEFAULTS.values())))


def dump_defaults(model_type: str) -> dict[str, Any]:
    """``AutoConfig.for_model(model_type).to_dict()``, without the label maps."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(model_type).to_dict()
    for key in ("id2label", "label2id"):
        cfg.pop(key, None)
        if isinstance(cfg.get("text_config"), dict):
            cfg["text_config"].pop(key, None)
    cfg.pop("vision_config", None)
    return cfg


def _shape(name: str, cfg: dict[str, Any]) -> ModelShape:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / f"{name}.json"
        path.write_text(json.dumps(cfg, default=str))
        shape = load_shape(str(path))
    return ModelShape(name=name, layers=shape.layers, source=SOURCES[name])


def generate(defaults: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Shape name -> its JSON dict, every one through the loader."""
    out = {name: _shape(name, cfg).to_dict() for name, cfg in PUBLISHED.items()}
    for name, model_type in FROM_DEFAULTS.items():
        out[name] = _shape(name, defaults[model_type]).to_dict()
    return dict(sorted(out.items()))


def _text(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=2, default=str) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare, write nothing")
    p.add_argument("--dump-config", metavar="MODEL_TYPE", help="print a model_type's defaults")
    args = p.parse_args(argv)
    if args.dump_config:
        print(_text(dump_defaults(args.dump_config)), end="")
        return 0
    if args.check:  # the shipped defaults dump stands in for transformers
        defaults = json.loads(DEFAULTS_FILE.read_text())
    else:
        defaults = {mt: dump_defaults(mt) for mt in MODEL_TYPES}
        defaults["_generated_by"] = "tools/gen_shapes.py (AutoConfig.for_model(...).to_dict())"
        DEFAULTS_FILE.write_text(_text(defaults))
    stale = []
    for name, data in generate(defaults).items():
        target = SHAPES / f"{name}.json"
        if args.check:
            if not target.is_file() or json.loads(target.read_text()) != data:
                stale.append(name)
        else:
            target.write_text(_text(data))
    if stale:
        print(f"stale shapes (rerun tools/gen_shapes.py): {', '.join(stale)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
