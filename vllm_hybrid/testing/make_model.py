"""Build a random-weight checkpoint of a hybrid architecture, offline and deterministic.

CLI::

    python -m vllm_hybrid.testing.make_model --arch zamba2 --out DIR [--size tiny|small]
        [--seed 0] [--dtype float32|bfloat16] [--force]

The output directory holds ``config.json``, ``model.safetensors``, ``generation_config.json``,
the tokenizer files (with a chat template) and a stamp file recording the build arguments.
Building again with the same arguments returns at once; the same seed gives identical weights.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING, CONFIG_MAPPING_NAMES

from vllm_hybrid.testing.archs import ARCHS, SIZES, TINY_VOCAB_SIZE, get_arch
from vllm_hybrid.testing.tokenizer import SPECIAL_TOKENS, save_tokenizer
from vllm_hybrid.testing.weights import INIT_STD, shape_output_head

#: Bump when the recipe changes (configs, init, tokenizer) so stale builds are rebuilt.
RECIPE_VERSION = 2
STAMP_NAME = "vllm_hybrid_stamp.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def build_stamp(arch: str, size: str, seed: int, dtype: str) -> dict[str, Any]:
    """What a build depends on; a directory whose stamp equals this one is up to date."""
    return {"arch": arch, "size": size, "seed": seed, "dtype": dtype, "recipe": RECIPE_VERSION}


def read_stamp(out_dir: Path) -> dict[str, Any] | None:
    """The stamp of the model in ``out_dir``, or None if there is none (or it is unreadable)."""
    try:
        stamp: dict[str, Any] = json.loads((out_dir / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None
    return stamp


def config_class(model_type: str) -> Any:
    """``transformers``' own config class for ``model_type``. Not ``CONFIG_MAPPING[model_type]``
    alone: vLLM registers its own classes there for some types when it loads such a model
    (``transformers_utils/config.py::_register_config_class``, e.g. its ``KimiLinearConfig``,
    which lacks ``num_local_experts``), so later builds in that process would get vLLM's."""
    import transformers

    name = CONFIG_MAPPING_NAMES.get(model_type)
    own = getattr(transformers, name, None) if name else None
    return own if own is not None else CONFIG_MAPPING[model_type]


def load_transformers_model(model_dir: str | os.PathLike[str], **kwargs: Any) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_pretrained(model_dir, **kwargs)`` with ``transformers``' own
    config class (see :func:`config_class`: after vLLM loaded the same model type in this
    process, ``AutoConfig`` would hand back vLLM's class)."""
    model_type = json.loads((Path(model_dir) / "config.json").read_text())["model_type"]
    config = config_class(model_type).from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, config=config, **kwargs)


def make_config(arch: str, size: str, dtype: str = "float32") -> Any:
    """The ``transformers`` config object of ``arch`` at ``size``."""
    spec = get_arch(arch)
    kwargs = spec.config_kwargs(size)
    return config_class(spec.model_type)(**kwargs, initializer_range=INIT_STD, dtype=dtype)


def make_model(arch: str, size: str = "tiny", seed: int = 0) -> PreTrainedModel:
    """A freshly initialised fp32 model (weights depend only on the arguments)."""
    config = make_config(arch, size)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    shape_output_head(model, TINY_VOCAB_SIZE, range(len(SPECIAL_TOKENS)), seed)
    post_init = get_arch(arch).post_init
    if post_init is not None:
        post_init(model)
    return model.eval()


@contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Serialise builds of the same directory across processes (e.g. pytest-xdist workers)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.parent / f".{out_dir.name}.lock"
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _write_build(tmp: Path, arch: str, size: str, seed: int, dtype: str) -> None:
    model = make_model(arch, size, seed)
    model.to(DTYPES[dtype])
    model.config.dtype = dtype
    model.save_pretrained(tmp)
    _rename_weights(tmp / "model.safetensors", get_arch(arch).checkpoint_renames)
    _keep_unknown_keys(tmp / "config.json", get_arch(arch).config_kwargs(size))
    save_tokenizer(tmp, TINY_VOCAB_SIZE)


def _rename_weights(path: Path, renames: tuple[tuple[str, str], ...]) -> None:
    """Rewrite ``path`` with each weight name's ``old`` substring replaced by ``new``."""
    if not renames:
        return
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    renamed = {}
    for name, tensor in tensors.items():
        for old, new in renames:
            name = name.replace(old, new)
        renamed[name] = tensor
    save_file(renamed, path, metadata={"format": "pt"})


def _keep_unknown_keys(config_path: Path, kwargs: dict[str, Any]) -> None:
    """Write the config keys the ``transformers`` class dropped but vLLM reads (e.g. LFM2's
    ``conv_dim`` and ``block_dim``, present in the released checkpoints' config.json)."""
    saved = json.loads(config_path.read_text())
    missing = {k: v for k, v in kwargs.items() if k not in saved}
    if missing:
        config_path.write_text(json.dumps({**saved, **missing}, indent=2, sort_keys=True) + "\n")


def _install(tmp: Path, out_dir: Path) -> None:
    """Move the files built in ``tmp`` into ``out_dir``; the stamp goes last."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / STAMP_NAME).unlink(missing_ok=True)
    for stale in out_dir.glob("*.safetensors*"):
        stale.unlink()
    for path in sorted(tmp.iterdir()):
        os.replace(path, out_dir / path.name)


def build_model(
    arch: str,
    out_dir: str | os.PathLike[str],
    size: str = "tiny",
    seed: int = 0,
    dtype: str = "float32",
    force: bool = False,
) -> Path:
    """Build (or reuse) a random-weight ``arch`` checkpoint in ``out_dir``; return its path.

    Idempotent: if ``out_dir`` already holds a build with the same arguments it is returned
    without rebuilding, unless ``force``. Safe to call from several processes at once.
    """
    get_arch(arch)
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; expected one of {SIZES}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    stamp = build_stamp(arch, size, seed, dtype)
    return build_checkpoint(
        out_dir, stamp, lambda tmp: _write_build(tmp, arch, size, seed, dtype), force
    )


def build_checkpoint(
    out_dir: str | os.PathLike[str],
    stamp: dict[str, Any],
    write: Callable[[Path], None],
    force: bool = False,
) -> Path:
    """Build a checkpoint into ``out_dir`` with ``write(tmp_dir)`` unless ``out_dir`` already
    holds one with this ``stamp`` (or ``force``); locked, written aside and moved in, the stamp
    last, so a reader never sees half a build. Returns the resolved path."""
    out = Path(out_dir).resolve()
    with _build_lock(out):
        if not force and read_stamp(out) == stamp:
            return out
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=f".{out.name}.build-") as tmp:
            write(Path(tmp))
            Path(tmp, STAMP_NAME).write_text(json.dumps(stamp, indent=2) + "\n")
            _install(Path(tmp), out)
    return out


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m vllm_hybrid.testing.make_model",
        description="Build a random-weight hybrid checkpoint with a local tokenizer (offline).",
    )
    parser.add_argument("--arch", required=True, choices=sorted(ARCHS))
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--size", default="tiny", choices=SIZES)
    parser.add_argument("--seed", default=0, type=int)
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: build the model and print where it is."""
    args = _parse_args(argv)
    start = time.perf_counter()
    path = build_model(args.arch, args.out, args.size, args.seed, args.dtype, args.force)
    spec = ARCHS[args.arch]
    cpu = ", ".join(spec.cpu_dtypes) or "no"
    print(f"{path}  [{args.arch} {args.size} seed={args.seed} {args.dtype}]")
    print(f"built in {time.perf_counter() - start:.1f}s; runs on vLLM CPU: {cpu}")
    print(spec.note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
