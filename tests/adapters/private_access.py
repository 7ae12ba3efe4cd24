"""Finds reaches into vLLM's internals (and other libraries') outside the compatibility layer.

The rules, applied to the AST of each module of ``vllm_hybrid`` but ``adapters/vllm/compat/``
(imports inside functions count as any other code):

R1  ``x._name`` (``x`` not ``self``/``cls``/``super()``; ``_name`` not a dunder) where
    ``_name`` is a private name of a vLLM class we touch (:data:`VLLM_CLASSES`: their methods,
    class attributes and ``self._name`` assignments) or is not a private name vllm_hybrid
    itself defines outside compat (a function, class, method, class attribute, module global,
    or ``self._name``/``x._name`` assignment).
R2  in a class with a vLLM class in its MRO: ``self._name``, ``cls._name``, ``super()._name``,
    or a method or class attribute ``_name``, where one of those vLLM classes defines
    ``_name`` (an override of, or a call to, a private vLLM method).
R3  ``getattr``/``hasattr``/``setattr``/``delattr`` with a literal private name: as R1 (R2
    when the object is ``self``).
R4  dunders: a write to ``x.__name__``-like attributes of anything but ``self`` (e.g. the
    ``__class__`` swap), or a read of the internals (:data:`INTERNAL_DUNDERS`: ``__dict__``,
    ``__dataclass_fields__``, ``__annotations__``, ...) of a name bound to a vLLM import.
R5  monkeypatch: an assignment, ``del`` or ``setattr`` on an attribute of a name bound to a
    vLLM import (a module, or anything imported from one).
R6  rebinding: assigning a lambda, a function defined in the module, or ``super().x`` to an
    attribute of anything but ``self``.
R7  importing a private name from vLLM, or a private vLLM module.

What it cannot see: a private name that vllm_hybrid also defines, used on a vLLM object of a
class outside :data:`VLLM_CLASSES`; a public-name instance rebinding through a value other
than those of R6. docs/compat.md states the rules; tests/adapters/test_compat.py runs them.
"""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "vllm_hybrid"
COMPAT = PACKAGE / "adapters" / "vllm" / "compat"
SELFISH = ("self", "cls")
ACCESSORS = ("getattr", "hasattr", "setattr", "delattr")
INTERNAL_DUNDERS = frozenset(
    {
        "__dict__",
        "__dataclass_fields__",
        "__annotations__",
        "__globals__",
        "__code__",
        "__closure__",
        "__defaults__",
        "__kwdefaults__",
        "__wrapped__",
        "__slots__",
    }
)
#: vLLM classes the adapter touches: their private names are private whoever else has them.
VLLM_CLASSES = (
    "vllm.v1.core.sched.scheduler:Scheduler",
    "vllm.v1.core.sched.async_scheduler:AsyncScheduler",
    "vllm.v1.core.block_pool:BlockPool",
    "vllm.v1.core.kv_cache_utils:FreeKVCacheBlockQueue",
    "vllm.v1.core.kv_cache_utils:KVCacheBlock",
    "vllm.v1.core.kv_cache_manager:KVCacheManager",
    "vllm.v1.core.kv_cache_coordinator:KVCacheCoordinator",
    "vllm.v1.core.kv_cache_coordinator:HybridKVCacheCoordinator",
    "vllm.v1.core.single_type_kv_cache_manager:SingleTypeKVCacheManager",
    "vllm.v1.core.single_type_kv_cache_manager:MambaManager",
    "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager",
    "vllm.v1.request:Request",
    "vllm.v1.metrics.stats:SchedulerStats",
    "vllm.config.scheduler:SchedulerConfig",
    "vllm.engine.arg_utils:EngineArgs",
    "vllm.distributed.kv_transfer.kv_connector.v1.base:KVConnectorBase_V1",
    "vllm.entrypoints.anthropic.serving:AnthropicServingMessages",
)


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.rule}: {self.detail}"


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def is_dunder(name: str) -> bool:
    return name.startswith("__") and name.endswith("__") and len(name) > 4


def modules(root: Path = PACKAGE) -> list[Path]:
    """Every module of the package but the compatibility layer."""
    return sorted(p for p in root.rglob("*.py") if COMPAT not in p.parents)


def module_name(path: Path) -> str:
    if PACKAGE.parent not in path.parents:
        return path.stem
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def defined_private_names(paths: list[Path]) -> set[str]:
    """Private names vllm_hybrid defines in ``paths`` (see R1)."""
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return {n for n in names if is_private(n)}


@functools.cache
def _class_private_names(cls: type) -> set[str]:
    names = {n for klass in cls.__mro__ if klass is not object for n in vars(klass)}
    try:
        tree = ast.parse(inspect.getsource(cls).lstrip())  # instance attributes set in methods
    except (OSError, TypeError, IndentationError):
        tree = None
    if tree is not None:
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                if node.value.id == "self" and isinstance(node.ctx, ast.Store):
                    names.add(node.attr)
    return {n for n in names if is_private(n)}


def vllm_private_names() -> set[str]:
    """The private names of :data:`VLLM_CLASSES` in the installed vLLM."""
    names: set[str] = set()
    for spec in VLLM_CLASSES:
        module, _, qualname = spec.partition(":")
        names |= _class_private_names(getattr(importlib.import_module(module), qualname))
    return names


def _vllm_bases(module: str, qualname: str, source: str) -> list[type] | None:
    """The vLLM classes in the MRO of class ``qualname`` of ``module`` (imported, if its
    ``source`` imports from vLLM at all); None if the module cannot be imported."""
    if "vllm." not in source and "import vllm" not in source:
        return []
    try:
        obj: object = importlib.import_module(module)
    except ImportError:
        return None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return _vllm_classes(obj)


def _vllm_classes(cls: object) -> list[type]:
    mro = getattr(cls, "__mro__", ())
    return [c for c in mro if (c.__module__ or "").split(".")[0] == "vllm"]


def _vllm_defines(bases: list[type], name: str) -> bool:
    return any(name in _class_private_names(c) for c in bases)


class _Scanner(ast.NodeVisitor):
    def __init__(self, path: Path, ours: set[str], theirs: set[str]) -> None:
        self.path, self.ours, self.theirs = path, ours, theirs
        self.module = module_name(path)
        self.source = path.read_text()
        self.found: list[Finding] = []
        self.classes: list[tuple[str, list[type]]] = []
        self.vllm_names: set[str] = set()  # names bound to vLLM imports (R5)
        self.imported: dict[str, tuple[str, str]] = {}  # name -> (module, attribute)
        self.functions: set[str] = set()  # functions defined in the module (R6)

    # ---------------------------------------------------------------- helpers
    def flag(self, node: ast.AST, rule: str, detail: str) -> None:
        where = self.path
        if PACKAGE.parent in where.parents:
            where = where.relative_to(PACKAGE.parent)
        self.found.append(Finding(str(where), getattr(node, "lineno", 0), rule, detail))

    def static_bases(self, node: ast.ClassDef) -> list[type]:
        """The vLLM classes behind ``node``'s bases, through the module's imports (for a
        module that cannot be imported)."""
        out: list[type] = []
        for base in node.bases:
            if isinstance(base, ast.Name) and base.id in self.imported:
                module, attr = self.imported[base.id]
                try:
                    out += _vllm_classes(getattr(importlib.import_module(module), attr))
                except (ImportError, AttributeError):
                    continue
        return out

    def bases(self) -> list[type]:
        return self.classes[-1][1] if self.classes else []

    def foreign(self, name: str) -> bool:
        return name in self.theirs or name not in self.ours

    def check_private(self, node: ast.AST, owner: ast.expr, name: str, how: str) -> None:
        if _is_self(owner):
            if _vllm_defines(self.bases(), name):
                self.flag(node, "R2", f"{how} vLLM's private {name!r} on self")
        elif self.foreign(name):
            self.flag(node, "R1" if how == "attribute" else "R3", f"{how} private {name!r}")

    # ---------------------------------------------------------------- visitors
    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        qualname = ".".join([c for c, _ in self.classes] + [node.name])
        bases = _vllm_bases(self.module, qualname, self.source)
        if bases is None:
            bases = self.static_bases(node)
        for item in node.body:
            names = _defined_in_body(item)
            for name in names:
                if is_private(name) and _vllm_defines(bases, name):
                    self.flag(item, "R2", f"overrides vLLM's private {name!r}")
        self.classes.append((node.name, bases))
        self.generic_visit(node)
        self.classes.pop()

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.split(".")[0] == "vllm":
                self.vllm_names.add((alias.asname or alias.name).split(".")[0])
                if any(is_private(p) for p in alias.name.split(".")):
                    self.flag(node, "R7", f"imports private vLLM module {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = node.module or ""
        if node.level == 0 and module.split(".")[0] == "vllm":
            if any(is_private(p) for p in module.split(".")):
                self.flag(node, "R7", f"imports from private vLLM module {module}")
            for alias in node.names:
                self.vllm_names.add(alias.asname or alias.name)
                self.imported[alias.asname or alias.name] = (module, alias.name)
                if is_private(alias.name):
                    self.flag(node, "R7", f"imports vLLM's private {alias.name}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if is_private(node.attr):
            self.check_private(node, node.value, node.attr, "attribute")
        elif is_dunder(node.attr) and not _is_self(node.value):
            if isinstance(node.ctx, (ast.Store, ast.Del)):
                self.flag(node, "R4", f"writes {node.attr}")
            elif node.attr in INTERNAL_DUNDERS and self._on_vllm(node.value):
                self.flag(node, "R4", f"reads {node.attr} of a vLLM object")
        if isinstance(node.ctx, (ast.Store, ast.Del)) and self._on_vllm(node.value):
            self.flag(node, "R5", f"patches {ast.unparse(node)}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if isinstance(func, ast.Name) and func.id in ACCESSORS and len(node.args) >= 2:
            owner, key = node.args[0], node.args[1]
            if isinstance(key, ast.Constant) and isinstance(key.value, str):
                if is_private(key.value):
                    self.check_private(node, owner, key.value, f"{func.id}()")
                if func.id in ("setattr", "delattr") and self._on_vllm(owner):
                    self.flag(node, "R5", f"{func.id} on {ast.unparse(owner)}")
            elif func.id in ("setattr", "delattr") and self._on_vllm(owner):
                self.flag(node, "R5", f"{func.id} on {ast.unparse(owner)}")
        self.generic_visit(node)

    def visit_Assign(self, node: ast.Assign) -> None:
        for target in node.targets:
            if isinstance(target, ast.Attribute) and not _is_self(target.value):
                if self._is_function_value(node.value):
                    self.flag(node, "R6", f"rebinds {ast.unparse(target)}")
        self.generic_visit(node)

    # ---------------------------------------------------------------- predicates
    def _on_vllm(self, owner: ast.expr) -> bool:
        root = owner
        while isinstance(root, ast.Attribute):
            root = root.value
        return isinstance(root, ast.Name) and root.id in self.vllm_names

    def _is_function_value(self, value: ast.expr) -> bool:
        if isinstance(value, ast.Lambda):
            return True
        if isinstance(value, ast.Name):
            return value.id in self.functions
        return isinstance(value, ast.Attribute) and _is_super(value.value)


def _is_super(node: ast.expr) -> bool:
    return (
        isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"
    )


def _is_self(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in SELFISH) or _is_super(node)


def _defined_in_body(item: ast.stmt) -> list[str]:
    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return [item.name]
    if isinstance(item, ast.Assign):
        return [t.id for t in item.targets if isinstance(t, ast.Name)]
    if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
        return [item.target.id]
    return []


def scan(path: Path, ours: set[str], theirs: set[str]) -> list[Finding]:
    tree = ast.parse(path.read_text())
    scanner = _Scanner(path, ours, theirs)
    scanner.functions = {
        n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    }
    scanner.visit(tree)
    return scanner.found


def findings(paths: list[Path] | None = None) -> Iterator[Finding]:
    """Every violation in ``paths`` (default: the package outside compat)."""
    paths = modules() if paths is None else paths
    ours = defined_private_names(modules())
    theirs = vllm_private_names()
    for path in paths:
        yield from scan(path, ours, theirs)
