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
