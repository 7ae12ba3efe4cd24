"""core/ is engine-agnostic: it imports only the standard library and itself."""

import ast
import sys
from pathlib import Path

CORE = Path(__file__).resolve().parents[2] / "vllm_hybrid" / "core"


def _imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append(node.module)
    return out


def test_core_imports_only_stdlib_and_itself() -> None:
    files = sorted(CORE.rglob("*.py"))  # subpackages too (core/index/)
    assert files, "no core modules found"
    bad = []
    for path in files:
        for name in _imports(path):
            top = name.split(".")[0]
            if name.startswith("vllm_hybrid.core") or top in sys.stdlib_module_names:
                continue
            if top == "__future__":
                continue
            bad.append(f"{path.relative_to(CORE)}: {name}")
    assert not bad, f"non-stdlib imports in core/: {bad}"


def test_scanner_sees_forbidden_imports(tmp_path: Path) -> None:
    probe = tmp_path / "m.py"
    probe.write_text("import torch\nfrom vllm.v1 import x\nimport json\n")
    assert _imports(probe) == ["torch", "vllm.v1", "json"]


def test_the_rest_of_the_package_uses_the_cores_public_api() -> None:
    """Outside core/, code imports the core as ``from vllm_hybrid.core import ...`` (its
    ``__all__``), never a submodule: the submodules are the implementation."""
    import vllm_hybrid.core as core

    package = CORE.parent
    root = package.parent
    bad = []
    for path in sorted(
        [
            *package.rglob("*.py"),
            *(root / "benchmarks").rglob("*.py"),
            *(root / "tools").rglob("*.py"),
        ]
    ):
        if CORE in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("vllm_hybrid.core."):
                    bad.append(f"{path.relative_to(root)}: from {node.module}")
                elif node.module == "vllm_hybrid.core":
                    bad += [
                        f"{path.relative_to(root)}: {a.name} is not in core.__all__"
                        for a in node.names
                        if a.name not in core.__all__
                    ]
            elif isinstance(node, ast.Import):
                bad += [
                    f"{path.relative_to(root)}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("vllm_hybrid.core.")
                ]
    assert not bad, bad
