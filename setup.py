"""Build script for vllm-hybrid's compiled ops.

Metadata lives in pyproject.toml; this file only describes the C++/CUDA extension(s):

* ``vllm_hybrid._C``: the CPU ops in ``csrc/cpu`` (ATen + OpenMP). Built whenever torch is
  importable at build time (install with ``--no-build-isolation``, see scripts/install.sh).
* CUDA sources in ``csrc/cuda`` are added when torch has CUDA and nvcc is found: the kernels
  (``*.cu``, sm_80 + sm_90 + PTX by default) and their torch glue (``*.cpp``), which registers
  the ops' CUDA implementations. tests/ops/test_cuda_compile.py compiles them with nvcc alone.

Environment switches:
  VLLM_HYBRID_SKIP_EXT=1    build no extension (pure-Python install; ops raise a clear error)
  VLLM_HYBRID_CUDA=0|1|auto skip / force / auto-detect the CUDA sources (default auto)
"""

from __future__ import annotations

import glob
import os

from setuptools import setup


def _cuda_wanted(torch_mod) -> bool:
    mode = os.environ.get("VLLM_HYBRID_CUDA", "auto").lower()
    if mode not in ("0", "1", "auto"):
        raise SystemExit(f"VLLM_HYBRID_CUDA must be 0, 1 or auto, got {mode!r}")
    if mode == "0":
        return False
    from torch.utils.cpp_extension import CUDA_HOME

    has_cuda = torch_mod.version.cuda is not None and CUDA_HOME is not None
    if mode == "1" and not has_cuda:
        raise SystemExit("VLLM_HYBRID_CUDA=1 but torch has no CUDA or nvcc was not found")
    return has_cuda and bool(glob.glob("csrc/cuda/*.cu"))


# Default GPU targets: A100 (sm_80), H100/H200 (sm_90) and PTX for newer GPUs. Setting
# TORCH_CUDA_ARCH_LIST (e.g. "8.0;9.0") hands the choice back to torch's defaults.
CUDA_ARCHS = ("80", "90")


def _cuda_arch_flags() -> list[str]:
    if os.environ.get("TORCH_CUDA_ARCH_LIST"):
        return []
    flags = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in CUDA_ARCHS]
    return flags + [f"-gencode=arch=compute_{CUDA_ARCHS[-1]},code=compute_{CUDA_ARCHS[-1]}"]


def _extensions():
    if os.environ.get("VLLM_HYBRID_SKIP_EXT") == "1":
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        print("vllm-hybrid: torch not importable at build time; building no extension")
        return [], {}
    sources = sorted(glob.glob("csrc/cpu/*.cpp")) + ["csrc/bindings.cpp"]
    cxx = ["-O3", "-fopenmp", "-std=c++20"]
    kwargs = dict(
        include_dirs=[os.path.abspath("csrc")],
        extra_compile_args={"cxx": cxx},
        extra_link_args=["-fopenmp"],
    )
    if _cuda_wanted(torch):
        # kernels (*.cu, CUDA headers only) + their torch glue (*.cpp, host compiler), which
        # registers the CUDA implementations of the ops declared in csrc/bindings.cpp
        sources += sorted(glob.glob("csrc/cuda/*.cu")) + sorted(glob.glob("csrc/cuda/*.cpp"))
        kwargs["extra_compile_args"]["nvcc"] = ["-O3", "-std=c++17", "-DVLLM_HYBRID_CUDA"]
        kwargs["extra_compile_args"]["nvcc"] += _cuda_arch_flags()
        kwargs["define_macros"] = [("VLLM_HYBRID_CUDA", None)]
        ext = CUDAExtension("vllm_hybrid._C", sources, **kwargs)
    else:
        ext = CppExtension("vllm_hybrid._C", sources, **kwargs)
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
