"""Compile-only check of the CUDA sources with the system nvcc (no GPU needed, nothing runs).

* every kernel file csrc/cuda/*.cu is compiled for sm_80 and sm_90 (they include only CUDA
  headers and csrc/snapshot_params.h), with the flags torch's extension builder adds to nvcc
  (COMMON_NVCC_FLAGS: no implicit half / bfloat16 conversions, relaxed constexpr);
* the torch glue csrc/cuda/*.cpp is compiled by nvcc (host compiler) against the installed
  torch's headers. A CPU build of torch ships c10/cuda but not the CMake-generated
  c10/cuda/impl/cuda_cmake_macros.h; -DC10_CUDA_NO_CMAKE_CONFIGURE_FILE skips that include
  (its only content is a Windows DLL-export switch);
* all objects are linked into one shared library, and no vllm_hybrid symbol may be left
  undefined (the glue's launchers are all provided by the kernels).
Linking against torch's CUDA libraries and running the kernels is benchmarks/gpu_check.sh's job.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.utils.cpp_extension import COMMON_NVCC_FLAGS

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "csrc"
KERNELS = sorted((CSRC / "cuda").glob("*.cu"))
GLUE = sorted((CSRC / "cuda").glob("*.cpp"))
GENCODE = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90,code=sm_90"]
TORCH_INCLUDE = Path(torch.__file__).parent / "include"


def find_nvcc() -> str | None:
    candidates = [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    if os.environ.get("CUDA_HOME"):
        candidates.append(os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc"))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


NVCC = find_nvcc()
pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not found (PATH, /usr/local/cuda)")


def compile_all(jobs: list[list[str]]) -> list[subprocess.CompletedProcess]:
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        return list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), jobs))


def assert_ok(results: list[subprocess.CompletedProcess]) -> None:
    failed = [r for r in results if r.returncode != 0]
    assert not failed, "\n\n".join(" ".join(r.args) + "\n" + r.stderr for r in failed)


def kernel_cmd(src: Path, out: Path) -> list[str]:
    flags = ["-std=c++17", "-O3", *COMMON_NVCC_FLAGS, *GENCODE, f"-I{CSRC}", "-Xcompiler", "-fPIC"]
    return [NVCC, *flags] + [
        "-c",
        str(src),
        "-o",
        str(out),
    ]


def glue_cmd(src: Path, out: Path) -> list[str]:
    return [
        NVCC,
        "-std=c++20",
        "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
        f"-I{CSRC}",
        f"-I{TORCH_INCLUDE}",
        f"-I{TORCH_INCLUDE / 'torch/csrc/api/include'}",
        "-Xcompiler",
        "-fPIC",
        "-c",
        str(src),
        "-o",
        str(out),
    ]


def test_every_cuda_source_compiles_for_sm80_and_sm90_and_links(tmp_path):
    assert KERNELS, "no csrc/cuda/*.cu"
    jobs = [kernel_cmd(src, tmp_path / f"{src.stem}.cu.o") for src in KERNELS]
    glue_ok = (TORCH_INCLUDE / "c10/cuda/CUDAStream.h").exists()
    if glue_ok:
        jobs += [glue_cmd(src, tmp_path / f"{src.stem}.cpp.o") for src in GLUE]
    assert_ok(compile_all(jobs))
    if not glue_ok:
        pytest.skip("kernels compiled; torch's c10/cuda headers are missing, glue not compiled")
    lib = tmp_path / "libvllm_hybrid_cuda_check.so"
    objects = sorted(str(p) for p in tmp_path.glob("*.o"))
    assert_ok(compile_all([[NVCC, "-shared", *GENCODE, "-o", str(lib), *objects]]))
    nm = shutil.which("nm")
    if nm is not None:
        undefined = subprocess.run([nm, "-C", "-u", str(lib)], capture_output=True, text=True)
        missing = [s for s in undefined.stdout.splitlines() if "vllm_hybrid::" in s]
        assert not missing, f"symbols the CUDA objects use but do not define: {missing}"


def _registered(path: Path, key: str) -> set[str]:
    text = path.read_text()
    block = re.search(rf"TORCH_LIBRARY_IMPL\(vllm_hybrid, {key}, m\) \{{(.*?)\n\}}", text, re.S)
    assert block, f"no {key} registration block in {path}"
    return set(re.findall(r'm\.impl\("(\w+)"', block.group(1)))


def test_every_cuda_op_has_a_cpu_twin():
    cuda_ops = set().union(*(_registered(p, "CUDA") for p in GLUE))
    assert cuda_ops and cuda_ops <= _registered(CSRC / "bindings.cpp", "CPU")
