"""Prompt modules: named stable segments, registered once, imported by prompts.

Engine-agnostic (stdlib only). In the spirit of Prompt Cache's Prompt Markup Language
(Gim et al., MLSys 2024): a schema names *modules* (a system prompt, a tool catalog, a
document) and the *paths* along which prompts import them, with *unions* of alternatives::

    {"modules": {"system": "You are ...", "tools": "...", "doc_a": "...", "doc_b": "..."},
     "paths": [["system", "tools", {"union": ["doc_a", "doc_b"]}]],
     "ttl_s": 600}

A path is an ordered list of module names; ``{"union": [...]}`` at a position means one of
those modules there. :meth:`ModuleSchema.parse` validates a schema and expands its unions into
concrete paths (``system, tools, doc_a`` and ``system, tools, doc_b``); the serving layer
(``vllm_hybrid/serving/modules.py``) tokenizes each module, prewarms each path with a breakpoint at
every module boundary (:func:`boundaries`), and builds importing prompts from the same token
ids, so a prompt's module boundaries fall on exactly the prewarmed positions.

Why only prefix order: a recurrent state summarizes every token before it, so the state at the
end of ``doc_b`` after ``system, tools`` is not the state at the end of ``doc_b`` after anything
else. Prompt Cache reuses attention KV of a module at any position (it re-encodes positions);
a hybrid model cannot reuse a module's state out of its context. A prompt reuses the states of
the longest registered path it starts with (:meth:`ModuleSchema.registered_prefix`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_hybrid.core.breakpoints import MAX_BREAKPOINTS, CacheOptionError, parse_ttl

#: Default time-to-live of the pins a registration takes (seconds).
DEFAULT_TTL_S = 600.0
#: At most this many modules in a schema, concrete paths after expansion, and modules on a path
#: (each module boundary is a breakpoint; a request carries at most MAX_BREAKPOINTS).
MAX_MODULES = 64
MAX_PATHS = 32
MAX_PATH_MODULES = MAX_BREAKPOINTS
#: A module's text, at most this many characters (the model's context bounds it anyway).
MAX_MODULE_CHARS = 1_000_000
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
FIELDS = ("modules", "paths", "ttl_s", "model", "cache_salt")
#: Where a request names the modules it imports: ``vllm_xargs["modules"]``.
IMPORT_KEY = "modules"


class ModuleError(CacheOptionError):
    """A schema or an import the server cannot take; the message names the field (HTTP 400)."""


@dataclass(frozen=True)
class ModuleSchema:
    """A validated schema: modules by name, the concrete paths its unions expand to."""

    modules: dict[str, str]
    paths: tuple[tuple[str, ...], ...]
    ttl_s: float = DEFAULT_TTL_S
    model: str | None = None
    cache_salt: str | None = None

    @classmethod
    def parse(cls, body: Any) -> ModuleSchema:
        """A schema from its JSON form; ModuleError naming the bad field."""
        if not isinstance(body, Mapping):
            raise ModuleError(f"modules: the schema must be a JSON object, got {_kind(body)}")
        unknown = sorted(set(body) - set(FIELDS))
        if unknown:
            raise ModuleError(f"modules: unknown field(s) {unknown}; valid: {', '.join(FIELDS)}")
        modules = _modules(body.get("modules"))
        raw_paths = body.get("paths", [])
        if not isinstance(raw_paths, list):
            raise ModuleError(f"paths must be a list of paths, got {_kind(raw_paths)}")
        alternatives = [_path(i, p, modules) for i, p in enumerate(raw_paths)]
        total = sum(math.prod(len(a) for a in path) for path in alternatives)
        if total > MAX_PATHS:
            raise ModuleError(
                f"paths expand to {total} concrete paths; at most {MAX_PATHS} (fewer unions or "
                "alternatives)"
            )
        try:
            ttl = parse_ttl(body["ttl_s"], "ttl_s") if "ttl_s" in body else DEFAULT_TTL_S
        except CacheOptionError as error:
            raise ModuleError(str(error)) from None
        return cls(
            modules=modules,
            paths=expand(alternatives),
            ttl_s=ttl,
            model=_optional_str(body, "model"),
            cache_salt=_optional_str(body, "cache_salt"),
        )

    def prewarm_paths(self) -> list[tuple[str, ...]]:
        """The paths to compute: every expanded path that no longer one extends (a prefix
        shared by several paths is computed by the first of them and hit by the others)."""
        return [
            p
            for p in self.paths
            if not any(len(q) > len(p) and q[: len(p)] == p for q in self.paths)
        ]

    def registered_prefix(self, names: Sequence[str]) -> int:
        """How many of ``names`` (an import, in order) follow a registered path from its start:
        the modules whose boundary states a prewarm computed."""
        best = 0
        for path in self.paths:
            n = 0
            while n < min(len(path), len(names)) and path[n] == names[n]:
                n += 1
            best = max(best, n)
        return best

    def parse_import(self, value: Any) -> list[str]:
        """A request's ``vllm_xargs["modules"]``: a non-empty list of registered names."""
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not value:
            raise ModuleError(
                f"{IMPORT_KEY}: {value!r} must be a non-empty list of registered module names"
            )
        if len(value) > MAX_PATH_MODULES:
            raise ModuleError(f"{IMPORT_KEY}: at most {MAX_PATH_MODULES} modules, got {len(value)}")
        for name in value:
            if name not in self.modules:
                known = ", ".join(sorted(self.modules)) or "none registered"
                raise ModuleError(f"{IMPORT_KEY}: unknown module {name!r}; registered: {known}")
        return list(value)

    def describe(self) -> dict[str, Any]:
        """The JSON form GET /v1/hybrid/modules answers with (texts by length only)."""
        return {
            "modules": {name: {"chars": len(text)} for name, text in self.modules.items()},
            "paths": [list(p) for p in self.paths],
            "ttl_s": self.ttl_s,
            "model": self.model,
            "cache_salt": self.cache_salt is not None,
        }


def expand(alternatives: Sequence[Sequence[Sequence[str]]]) -> tuple[tuple[str, ...], ...]:
    """Paths given as alternatives per position -> concrete paths, in order, without repeats."""
    out: dict[tuple[str, ...], None] = {}
    for path in alternatives:
        partial: list[tuple[str, ...]] = [()]
        for choices in path:
            partial = [p + (c,) for p in partial for c in choices]
        out.update(dict.fromkeys(partial))
    return tuple(out)


def boundaries(lengths: Sequence[int], lead: int = 0) -> list[int]:
    """Token positions where each module ends, for modules of ``lengths`` tokens placed after
    ``lead`` tokens (the special tokens a tokenizer puts before a prompt)."""
    out, at = [], lead
    for n in lengths:
        at += n
        out.append(at)
    return out


def _modules(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping) or not value:
        raise ModuleError(
            f'modules must be a non-empty object {{"name": "text", ...}}, got {_kind(value)}'
        )
    if len(value) > MAX_MODULES:
        raise ModuleError(f"modules: at most {MAX_MODULES} modules, got {len(value)}")
    out = {}
    for name, text in value.items():
        if not NAME.fullmatch(str(name)):
            raise ModuleError(
                f"modules: name {name!r} must be 1-64 letters, digits, '_', '.' or '-'"
            )
        if not isinstance(text, str):
            raise ModuleError(
                f"modules.{name} must be a string (the module's text), got {_kind(text)}"
            )
        if not text.strip():
            raise ModuleError(f"modules.{name} is empty")
        if len(text) > MAX_MODULE_CHARS:
            raise ModuleError(f"modules.{name}: {len(text)} characters; at most {MAX_MODULE_CHARS}")
        out[str(name)] = text
    return out


def _path(i: int, value: Any, modules: Mapping[str, str]) -> list[list[str]]:
    """Path ``i``: for each position, the module names allowed there."""
    where = f"paths[{i}]"
    if not isinstance(value, list) or not value:
        raise ModuleError(f"{where} must be a non-empty list of module names, got {_kind(value)}")
    if len(value) > MAX_PATH_MODULES:
        raise ModuleError(
            f"{where}: at most {MAX_PATH_MODULES} modules on a path, got {len(value)}"
        )
    out = []
    for j, item in enumerate(value):
        at = f"{where}[{j}]"
        if isinstance(item, Mapping):
            if set(item) != {"union"}:
                raise ModuleError(
                    f'{at} must be a module name or {{"union": [names]}}, got {dict(item)!r}'
                )
            names = item["union"]
            if not isinstance(names, list) or not names:
                raise ModuleError(f"{at}.union must be a non-empty list of module names")
            if len(set(map(str, names))) != len(names):
                raise ModuleError(f"{at}.union names a module twice: {names!r}")
            at += ".union"
        elif isinstance(item, str):
            names = [item]
        else:
            raise ModuleError(
                f'{at} must be a module name or {{"union": [names]}}, got {_kind(item)}'
            )
        for name in names:
            if not isinstance(name, str) or name not in modules:
                raise ModuleError(
                    f"{at}: unknown module {name!r}; defined: {', '.join(sorted(modules))}"
                )
        out.append(list(names))
    return out


def _optional_str(body: Mapping[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ModuleError(f"{key} must be a non-empty string, got {_kind(value)}")
    return value


def _kind(value: Any) -> str:
    return type(value).__name__
