"""Prompt modules on the server: ``POST /v1/hybrid/modules`` (or the ``modules`` setting's file at
startup) registers them, ``GET`` lists them, a completion with ``vllm_xargs: {"modules": [...]}``
imports them. The schema and its rules are ``core/modules.py``; here each module is tokenized
by vLLM's ``/tokenize``, and every path is prewarmed and pinned with a breakpoint at each
module boundary (``prewarm.py``)."""

from __future__ import annotations

import logging
from typing import Any

from vllm_hybrid.core import (
    IMPORT_KEY,
    CacheOptionError,
    ModuleError,
    ModuleSchema,
    boundaries,
    merge_breakpoints,
)
from vllm_hybrid.serving.asgi import AppClient, Scope, Upstream, error_body
from vllm_hybrid.serving.prewarm import CheckTTL, compute_and_pin

logger = logging.getLogger("vllm_hybrid")

MODULES = "/v1/hybrid/modules"


class Modules:
    """Registered prompt modules: the schema, each module's token ids, the lead tokens."""

    def __init__(self, schema: ModuleSchema, lead: list[int], ids: dict[str, list[int]]):
        self.schema, self.lead, self.ids = schema, lead, ids
        self.prewarmed: list[dict[str, Any]] = []

    def prompt(self, names: Any) -> tuple[list[int], list[int]]:
        """The token ids of ``names`` in order (after the lead) and each module's end."""
        ids = list(self.lead)
        for name in names:
            ids += self.ids[name]
        return ids, boundaries([len(self.ids[n]) for n in names], len(self.lead))

    def describe(self) -> dict[str, Any]:
        out = {"object": "hybrid.modules", **self.schema.describe()}
        for name, entry in out["modules"].items():
            entry["tokens"] = len(self.ids[name])
        out["lead_tokens"] = len(self.lead)
        out["prewarmed"] = self.prewarmed
        return out


def describe(registered: Modules | None) -> dict[str, Any]:
    """``GET /v1/hybrid/modules``: what is registered (``modules`` empty if nothing)."""
    if registered is None:
        return {"object": "hybrid.modules", "modules": {}}
    return registered.describe()


async def register(
    client: AppClient, scope: Scope, body: Any, check_ttl: CheckTTL
) -> tuple[int, Any, Modules | None]:
    """Validate a schema (``core/modules.py``), tokenize each module, prewarm and pin every
    path (breakpoints at its module boundaries). (400, error, None) on a bad schema; vLLM's
    own (status, answer, None) if it refuses a call; else (200, the registration, the new
    modules, which replace what was registered)."""
    try:
        schema = ModuleSchema.parse(body)
        check_ttl("ttl_s", schema.ttl_s, ModuleError)
        model = {"model": schema.model} if schema.model is not None else {}
        # The special tokens the tokenizer puts before a prompt (none on many models).
        lead = await client.tokens(scope, {**model, "prompt": "", "add_special_tokens": True})
        ids = {}
        for name, text in schema.modules.items():
            ids[name] = await client.tokens(
                scope, {**model, "prompt": text, "add_special_tokens": False}
            )
            if not ids[name]:
                raise ModuleError(f"modules.{name} tokenizes to no token")
    except CacheOptionError as error:
        return 400, error_body(str(error)), None
    except Upstream as upstream:
        return upstream.status, upstream.answer, None
    registered = Modules(schema, lead, ids)
    # One at a time, in order: a prefix shared by several paths is computed by the first
    # (its boundary state kept by the breakpoint there) and hit by the others.
    for path in schema.prewarm_paths():
        prompt, bounds = registered.prompt(path)
        status, payload, refused = await compute_and_pin(
            client, scope, prompt, schema.ttl_s, schema.model, schema.cache_salt, bounds
        )
        if status != 200 and refused is None:
            return status, payload, None  # nothing registered
        registered.prewarmed.append(_prewarmed(path, bounds, prompt, payload, refused))
    logger.info(
        "vllm-hybrid: registered %d prompt modules, %d paths",
        len(schema.modules),
        len(schema.paths),
    )
    return 200, registered.describe(), registered


def _prewarmed(
    path: Any, bounds: list[int], prompt: list[int], payload: Any, refused: str | None
) -> dict[str, Any]:
    """One path's entry in the registration's ``prewarmed`` list."""
    entry: dict[str, Any] = {"path": list(path), "boundaries": bounds}
    if refused is None:
        entry.update(
            pinned=True,
            **{k: payload[k] for k in ("prompt_tokens", "cached_tokens", "pinned_tokens")},
            pinned_pages=payload["pinned_pages"],
        )
    else:  # computed and cached, not pinned (e.g. over max_pinned_fraction)
        entry.update(pinned=False, prompt_tokens=len(prompt), message=refused)
    return entry


async def import_modules(
    client: AppClient,
    scope: Scope,
    registered: Modules | None,
    body: dict[str, Any],
    xargs: dict[str, Any],
) -> dict[str, Any]:
    """A completion importing modules: the prompt becomes the modules' token ids (as
    registered, so the boundaries fall where the prewarm put them) followed by the
    request's own prompt (tokenized without special tokens), with a breakpoint at every
    module boundary. ``vllm_xargs["modules"]`` is removed."""
    if registered is None:
        raise ModuleError(f"{IMPORT_KEY}: no prompt modules are registered (POST {MODULES} first)")
    names = registered.schema.parse_import(xargs[IMPORT_KEY])
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        render = {"prompt": prompt, "add_special_tokens": False}
        if body.get("model") is not None:
            render["model"] = body["model"]
        rest = await client.tokens(scope, render) if prompt else []
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        rest = list(prompt)
    else:
        raise ModuleError(
            f"{IMPORT_KEY}: a request importing modules takes one prompt (text or token ids)"
        )
    ids, bounds = registered.prompt(names)
    others = {k: v for k, v in xargs.items() if k != IMPORT_KEY}
    return dict(body, prompt=ids + rest, vllm_xargs=merge_breakpoints(others, bounds))
