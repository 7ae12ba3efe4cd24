"""Prompt-module schema (core/modules.py): parsing, validation, expansion, imports."""

from __future__ import annotations

import pytest

from vllm_hybrid.core.breakpoints import MAX_BREAKPOINTS
from vllm_hybrid.core.modules import (
    DEFAULT_TTL_S,
    MAX_PATHS,
    ModuleError,
    ModuleSchema,
    boundaries,
    expand,
)

MODULES = {"system": "You are a clerk.", "tools": "t1 t2", "doc_a": "A", "doc_b": "B"}


def schema(**extra):
    return ModuleSchema.parse({"modules": MODULES, **extra})


def test_unions_expand_to_concrete_paths_in_order():
    s = schema(paths=[["system", "tools", {"union": ["doc_a", "doc_b"]}]], ttl_s=60)
    assert s.paths == (("system", "tools", "doc_a"), ("system", "tools", "doc_b"))
    assert s.ttl_s == 60.0 and s.model is None and s.cache_salt is None


def test_two_unions_make_the_product_and_repeats_are_dropped():
    paths = [
        [{"union": ["system", "tools"]}, {"union": ["doc_a", "doc_b"]}],
        ["system", "doc_a"],  # already there
    ]
    assert schema(paths=paths).paths == (
        ("system", "doc_a"),
        ("system", "doc_b"),
        ("tools", "doc_a"),
        ("tools", "doc_b"),
    )
    assert expand([[["a"], ["b", "c"]], [["a"]]]) == (("a", "b"), ("a", "c"), ("a",))


def test_prewarm_paths_skip_prefixes_of_longer_paths():
    s = schema(paths=[["system"], ["system", "tools"], ["system", {"union": ["doc_a", "doc_b"]}]])
    assert s.prewarm_paths() == [("system", "tools"), ("system", "doc_a"), ("system", "doc_b")]


def test_defaults_and_optional_fields():
    s = ModuleSchema.parse({"modules": {"m": "x"}})
    assert s.paths == () and s.prewarm_paths() == [] and s.ttl_s == DEFAULT_TTL_S
    s = schema(paths=[["system"]], model="tiny", cache_salt="tenant-1")
    assert (s.model, s.cache_salt) == ("tiny", "tenant-1")
    assert s.describe() == {
        "modules": {name: {"chars": len(text)} for name, text in MODULES.items()},
        "paths": [["system"]],
        "ttl_s": DEFAULT_TTL_S,
        "model": "tiny",
        "cache_salt": True,
    }


def test_boundaries_are_cumulative_after_the_lead():
    assert boundaries([300, 250]) == [300, 550]
    assert boundaries([300, 250], lead=1) == [301, 551]
    assert boundaries([]) == []


def test_registered_prefix_counts_modules_along_a_path():
    s = schema(paths=[["system", {"union": ["doc_a", "doc_b"]}]])
    assert s.registered_prefix(["system", "doc_b"]) == 2
    assert s.registered_prefix(["system", "doc_b", "tools"]) == 2
    assert s.registered_prefix(["system", "tools"]) == 1
    assert s.registered_prefix(["doc_b", "system"]) == 0  # out of order: no state to reuse


def test_imports():
    s = schema(paths=[["system"]])
    assert s.parse_import(["system", "doc_b"]) == ["system", "doc_b"]
    assert s.parse_import("system") == ["system"]
    with pytest.raises(ModuleError, match=r"unknown module 'nope'; registered: doc_a, doc_b"):
        s.parse_import(["system", "nope"])
    for bad in ([], None, 3, [1]):
        with pytest.raises(ModuleError, match="modules"):
            s.parse_import(bad)
    with pytest.raises(ModuleError, match=f"at most {MAX_BREAKPOINTS}"):
        s.parse_import(["system"] * (MAX_BREAKPOINTS + 1))


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("text", "the schema must be a JSON object, got str"),
        ({"modules": MODULES, "path": []}, "unknown field(s) ['path']"),
        ({}, "modules must be a non-empty object"),
        ({"modules": {}}, "modules must be a non-empty object"),
        ({"modules": ["system"]}, "modules must be a non-empty object"),
        ({"modules": {"a b": "x"}}, "name 'a b' must be 1-64 letters"),
        ({"modules": {"m": 5}}, "modules.m must be a string"),
        ({"modules": {"m": "  \n"}}, "modules.m is empty"),
        ({"modules": MODULES, "paths": "system"}, "paths must be a list of paths, got str"),
        ({"modules": MODULES, "paths": [[]]}, "paths[0] must be a non-empty list"),
        ({"modules": MODULES, "paths": ["system"]}, "paths[0] must be a non-empty list"),
        ({"modules": MODULES, "paths": [["system"], ["sys"]]}, "paths[1][0]: unknown module 'sys'"),
        (
            {"modules": MODULES, "paths": [["system", {"union": ["doc_a", "doc_c"]}]]},
            "paths[0][1].union: unknown module 'doc_c'; defined: doc_a, doc_b, system, tools",
        ),
        ({"modules": MODULES, "paths": [[{"union": []}]]}, "paths[0][0].union must be a non-empty"),
        ({"modules": MODULES, "paths": [[{"union": ["doc_a", "doc_a"]}]]}, "names a module twice"),
        ({"modules": MODULES, "paths": [[{"one_of": ["doc_a"]}]]}, 'or {"union": [names]}'),
        ({"modules": MODULES, "paths": [[7]]}, "paths[0][0] must be a module name"),
        ({"modules": MODULES, "paths": [["system"] * 9]}, "at most 8 modules on a path"),
        ({"modules": MODULES, "ttl_s": 0}, "ttl_s: 0 must be a positive number"),
        ({"modules": MODULES, "ttl_s": "1h"}, "ttl_s: '1h' must be a number"),
        ({"modules": MODULES, "model": 3}, "model must be a non-empty string"),
        ({"modules": MODULES, "cache_salt": ""}, "cache_salt must be a non-empty string"),
    ],
)
def test_bad_schemas_name_the_field(body, message):
    with pytest.raises(ModuleError) as error:
        ModuleSchema.parse(body)
    assert message in str(error.value)


def test_too_many_expanded_paths_is_refused_before_expanding():
    modules = {f"m{i}": "x" for i in range(10)}
    union = {"union": list(modules)}
    with pytest.raises(ModuleError, match=f"expand to 1000 concrete paths; at most {MAX_PATHS}"):
        ModuleSchema.parse({"modules": modules, "paths": [[union, union, union]]})
    with pytest.raises(ModuleError, match="at most 64 modules"):
        ModuleSchema.parse({"modules": {f"m{i}": "x" for i in range(65)}})


def test_the_modules_setting_names_a_valid_schema_file(tmp_path):
    from vllm_hybrid.core.config import ConfigError, HybridCacheConfig

    good = tmp_path / "modules.json"
    good.write_text('{"modules": {"system": "x"}, "paths": [["system"]]}')
    assert HybridCacheConfig.from_sources({"modules": str(good)}, {}).modules == str(good)
    assert HybridCacheConfig.from_sources(None, {"VLLM_HYBRID_MODULES": str(good)}).modules
    assert HybridCacheConfig.from_sources(None, {}).modules == ""
    bad = tmp_path / "bad.json"
    for content, message in (
        ("{", "not JSON"),
        ('{"modules": {"system": "x"}, "paths": [["nope"]]}', "paths[0][0]: unknown module"),
    ):
        bad.write_text(content)
        with pytest.raises(ConfigError, match=r"modules file .*bad.json.*: ") as error:
            HybridCacheConfig.from_sources({"modules": str(bad)}, {})
        assert message in str(error.value)
    with pytest.raises(ConfigError, match="No such file"):
        HybridCacheConfig.from_sources({"modules": str(tmp_path / "none.json")}, {})
    with pytest.raises(ConfigError, match="must be a file path"):
        HybridCacheConfig.from_sources({"modules": 3}, {})
