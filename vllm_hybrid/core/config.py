"""The hybrid cache's settings: one validated object, from a mapping and the environment.

Engines hand the user's settings over as a plain mapping (vLLM: the ``"vllm_hybrid"`` entry of
``--additional-config`` / ``LLM(additional_config=...)``); environment variables fill in what
the mapping leaves out, then the defaults. Every bad value fails here, at engine start, with a
message that names the setting and the values it accepts, so nothing is lost later.

==================  =====================  =======================  =========================
key                 environment            default                  meaning
==================  =====================  =======================  =========================
``policy``          VLLM_HYBRID_POLICY     ``flop``                 eviction policy (a name of
                                                                    ``core.policies.POLICIES``)
                                                                    or ``stock``: leave the
                                                                    engine's own cache alone
``snapshot_every``  VLLM_HYBRID_SNAPSHOT_  ``engine``               periodic state snapshots:
                    EVERY                                           ``engine`` (keep the
                                                                    engine's setting), ``auto``
                                                                    (the policy's interval),
                                                                    ``dense`` (every block) or
                                                                    a token count (0: only
                                                                    prompt ends and
                                                                    shared-prefix junctions)
``shape``           VLLM_HYBRID_SHAPE      ``auto``                 cost model's FLOPs: a
                                                                    shipped shape, a JSON path,
                                                                    or ``auto`` (by model type)
``debug``           VLLM_HYBRID_DEBUG      ``false``                integrity checks after
                                                                    every scheduler step
``max_pinned_       VLLM_HYBRID_MAX_       ``0.25``                 share of the pool's pages
fraction``          PINNED_FRACTION                                 that pins (prewarm) may
                                                                    hold at once, in [0, 1]
``max_snapshot_     VLLM_HYBRID_MAX_       ``1`` (no budget of      share of the pool's pages
fraction``          SNAPSHOT_FRACTION      their own)               that free cached state
                                                                    snapshots may hold, in
                                                                    [0, 1]; over it the
                                                                    policy's lowest go at once
``max_pin_ttl_s``   VLLM_HYBRID_MAX_PIN_   ``3600``                 longest pin TTL accepted,
                    TTL_S                                           in seconds
``modules``         VLLM_HYBRID_MODULES    ``""`` (none)            a prompt-module schema
                                                                    file (JSON, see
                                                                    ``core/modules.py``) the
                                                                    server registers and
                                                                    prewarms at start
``host_tier_gb``    VLLM_HYBRID_HOST_      ``0`` (off)              host-memory tier for
                    TIER_GB                                         state snapshots the policy
                                                                    evicts alone, in GB (1e9
                                                                    bytes; docs/host_tier.md)
``match_unit``      VLLM_HYBRID_MATCH_     ``auto``                 the engine's prefix match
                    UNIT                                            unit (vLLM's
                                                                    ``prefix_match_unit``) when
                                                                    the user set none: ``auto``
                                                                    (1 token for a hybrid in
                                                                    align mode: exact resume),
                                                                    ``block`` (vLLM's default)
                                                                    or a token count
``system_           VLLM_HYBRID_SYSTEM_    ``true``                 the server ends a chat
breakpoint``        BREAKPOINT                                      request's first prefill
                                                                    chunk where its system
                                                                    prompt ends (the next
                                                                    message's role header
                                                                    included) when it has no
                                                                    ``cache_control`` marks,
                                                                    so the state there is kept
                                                                    for other conversations
``exact_prompt_     VLLM_HYBRID_EXACT_     ``false``                at a one-token match unit,
end``               PROMPT_END                                      ``true`` keeps vLLM's
                                                                    state after a prompt's
                                                                    last token but one also
                                                                    where that costs a forward
                                                                    pass of its own (a prompt
                                                                    whose last chunk starts in
                                                                    its last block); that pass
                                                                    computes one prompt token
                                                                    with vLLM's CPU decode
                                                                    kernels, which can change
                                                                    a greedy output against an
                                                                    unchunked prefill
                                                                    (docs/reliability.md), and
                                                                    costs a step per hit;
                                                                    ``false`` (the default)
                                                                    runs the chunk to the end:
                                                                    an exact repeat resumes at
                                                                    the block floor instead
``sibling_wait``    VLLM_HYBRID_SIBLING_   ``true``                 a waiting request whose
                    WAIT                                            prompt shares at least a
                                                                    block more with a request
                                                                    still computing its
                                                                    prompt than the cache
                                                                    holds waits (a step at a
                                                                    time) until that request
                                                                    has kept a state where
                                                                    the two diverge, then
                                                                    resumes there instead of
                                                                    computing the same prefix
                                                                    beside it
                                                                    (``core.sibling_stop``)
==================  =====================  =======================  =========================
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_hybrid.core.modules import ModuleError, ModuleSchema
from vllm_hybrid.core.policies import POLICIES

STOCK = "stock"
ENV = {
    "policy": "VLLM_HYBRID_POLICY",
    "snapshot_every": "VLLM_HYBRID_SNAPSHOT_EVERY",
    "shape": "VLLM_HYBRID_SHAPE",
    "debug": "VLLM_HYBRID_DEBUG",
    "max_pinned_fraction": "VLLM_HYBRID_MAX_PINNED_FRACTION",
    "max_snapshot_fraction": "VLLM_HYBRID_MAX_SNAPSHOT_FRACTION",
    "max_pin_ttl_s": "VLLM_HYBRID_MAX_PIN_TTL_S",
    "modules": "VLLM_HYBRID_MODULES",
    "host_tier_gb": "VLLM_HYBRID_HOST_TIER_GB",
    "match_unit": "VLLM_HYBRID_MATCH_UNIT",
    "system_breakpoint": "VLLM_HYBRID_SYSTEM_BREAKPOINT",
    "exact_prompt_end": "VLLM_HYBRID_EXACT_PROMPT_END",
    "sibling_wait": "VLLM_HYBRID_SIBLING_WAIT",
}
SNAPSHOT_MODES = ("auto", "engine", "dense")
MATCH_UNIT_MODES = ("auto", "block")
#: The match unit ``auto`` picks: one token, so a next turn resumes at the exact end of the
#: previous prompt + answer and a breakpoint or junction is exact. Its cost is vLLM's hashing,
#: one chained hash per token (~1.4 us a token with sha256; docs/scheduler_overhead.md).
AUTO_MATCH_UNIT = 1
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


class ConfigError(ValueError):
    """A setting the hybrid cache cannot run with; the message says which and why."""


@dataclass(frozen=True)
class HybridCacheConfig:
    """Validated settings (see the module docstring for each field)."""

    policy: str = "flop"
    snapshot_every: str | int = "engine"
    shape: str = "auto"
    debug: bool = False
    max_pinned_fraction: float = 0.25
    max_snapshot_fraction: float = 1.0
    max_pin_ttl_s: float = 3600.0
    modules: str = ""
    host_tier_gb: float = 0.0
    match_unit: str | int = "auto"
    system_breakpoint: bool = True
    exact_prompt_end: bool = False
    sibling_wait: bool = True

    @property
    def enabled(self) -> bool:
        return self.policy != STOCK

    def engine_match_unit(self, user_unit: int | None, hybrid_align: bool) -> int | None:
        """The prefix match unit to give the engine, or None to leave the engine's setting
        alone: an explicit user setting always wins, ``stock`` changes nothing, and only a
        hybrid whose state groups take sub-block hits (vLLM: align mode) gets one."""
        if user_unit is not None or not self.enabled or not hybrid_align:
            return None
        if self.match_unit == "block":
            return None
        return AUTO_MATCH_UNIT if self.match_unit == "auto" else int(self.match_unit)

    def snapshot_budget_pages(self, pool_pages: int) -> int | None:
        """The snapshot budget in pages of a pool of ``pool_pages`` (None: no budget of their
        own, at the default share 1)."""
        if self.max_snapshot_fraction >= 1.0:
            return None
        return int(self.max_snapshot_fraction * pool_pages)

    def snapshot_budget_warning(self, pool_pages: int, snapshot_pages: int) -> str:
        """A warning when the budget cannot hold one snapshot of ``snapshot_pages`` (one page
        per state group), else ''."""
        budget = self.snapshot_budget_pages(pool_pages)
        if budget is None or budget >= snapshot_pages:
            return ""
        return (
            f"max_snapshot_fraction {self.max_snapshot_fraction:g} leaves {budget} pages of "
            f"{pool_pages}, under one snapshot ({snapshot_pages} pages): no state outlives its "
            "request, so nothing will hit"
        )

    @property
    def host_tier_bytes(self) -> int:
        """The host tier's budget in bytes (0: the tier is off)."""
        return int(self.host_tier_gb * 1e9)

    @classmethod
    def from_sources(
        cls, settings: Mapping[str, Any] | None, env: Mapping[str, str]
    ) -> HybridCacheConfig:
        """``settings`` (may be None) over ``env`` over the defaults; ConfigError on bad values."""
        settings = dict(settings or {})
        unknown = sorted(set(settings) - set(ENV))
        if unknown:
            raise ConfigError(
                f"vllm_hybrid: unknown setting(s) {unknown}; valid: {', '.join(sorted(ENV))}"
            )
        raw: dict[str, Any] = {}
        for key, var in ENV.items():
            if key in settings:
                raw[key] = settings[key]
            elif var in env:
                raw[key] = env[var]
        return cls(
            policy=_policy(raw.get("policy", cls.policy)),
            snapshot_every=_snapshot_every(raw.get("snapshot_every", cls.snapshot_every)),
            shape=_nonempty("shape", raw.get("shape", cls.shape)),
            debug=_flag("debug", raw.get("debug", cls.debug)),
            max_pinned_fraction=_number(
                "max_pinned_fraction",
                raw.get("max_pinned_fraction", cls.max_pinned_fraction),
                low=0.0,
                high=1.0,
            ),
            max_snapshot_fraction=_number(
                "max_snapshot_fraction",
                raw.get("max_snapshot_fraction", cls.max_snapshot_fraction),
                low=0.0,
                high=1.0,
            ),
            max_pin_ttl_s=_number(
                "max_pin_ttl_s", raw.get("max_pin_ttl_s", cls.max_pin_ttl_s), low=0.0
            ),
            modules=_modules_file(raw.get("modules", cls.modules)),
            host_tier_gb=_number(
                "host_tier_gb", raw.get("host_tier_gb", cls.host_tier_gb), low=0.0, high=1e6
            ),
            match_unit=_match_unit(raw.get("match_unit", cls.match_unit)),
            system_breakpoint=_flag(
                "system_breakpoint", raw.get("system_breakpoint", cls.system_breakpoint)
            ),
            exact_prompt_end=_flag(
                "exact_prompt_end", raw.get("exact_prompt_end", cls.exact_prompt_end)
            ),
            sibling_wait=_flag("sibling_wait", raw.get("sibling_wait", cls.sibling_wait)),
        )


def _policy(value: Any) -> str:
    name = str(value).strip()
    if name != STOCK and name not in POLICIES:
        valid = ", ".join([STOCK, *sorted(POLICIES)])
        raise ConfigError(f"vllm_hybrid: policy {value!r} is not a policy; valid: {valid}")
    return name


def _snapshot_every(value: Any) -> str | int:
    text = str(value).strip()
    if text in SNAPSHOT_MODES:
        return text
    if not isinstance(value, bool) and text.isdigit():
        return int(text)
    raise ConfigError(
        f"vllm_hybrid: snapshot_every {value!r} must be one of {', '.join(SNAPSHOT_MODES)} "
        "or a non-negative token count"
    )


def _match_unit(value: Any) -> str | int:
    text = str(value).strip()
    if text in MATCH_UNIT_MODES:
        return text
    if not isinstance(value, bool) and text.isdigit() and int(text) > 0:
        return int(text)
    raise ConfigError(
        f"vllm_hybrid: match_unit {value!r} must be one of {', '.join(MATCH_UNIT_MODES)} "
        "or a positive token count that divides the block size"
    )


def _modules_file(value: Any) -> str:
    """A prompt-module schema file: readable JSON that parses as a schema ('' for none)."""
    if not isinstance(value, str):
        raise ConfigError(f"vllm_hybrid: modules {value!r} must be a file path (a string)")
    path = value.strip()
    if not path:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            ModuleSchema.parse(json.load(f))
    except OSError as error:
        raise ConfigError(f"vllm_hybrid: modules file {path!r}: {error.strerror}") from None
    except ValueError as error:  # bad JSON, or a bad schema (ModuleError)
        kind = "" if isinstance(error, ModuleError) else "not JSON: "
        raise ConfigError(f"vllm_hybrid: modules file {path!r}: {kind}{error}") from None
    return path


def _nonempty(key: str, value: Any) -> str:
    text = str(value).strip()
    if not text:
        raise ConfigError(f"vllm_hybrid: {key} must not be empty")
    return text


def _number(key: str, value: Any, low: float, high: float | None = None) -> float:
    try:
        number = float(value) if not isinstance(value, bool) else float("nan")
    except (TypeError, ValueError):
        number = float("nan")
    if not low <= number <= (high if high is not None else float("inf")):
        bounds = f"in [{low:g}, {high:g}]" if high is not None else f"at least {low:g}"
        raise ConfigError(f"vllm_hybrid: {key} {value!r} must be a number {bounds}")
    return number


def _flag(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"vllm_hybrid: {key} {value!r} must be true or false")


def periodic_interval(setting: str | int, policy_interval: int | None, block_tokens: int) -> int:
    """Tokens between periodic snapshots for a resolved ``snapshot_every`` (not ``engine``):
    ``0`` none (prompt ends and junctions only), ``block_tokens`` every block (``dense``).
    A token count must be a multiple of ``block_tokens``; ``auto`` uses the policy's
    ``interval_tokens`` (rounded to blocks) or 0 if it has none."""
    if setting == "dense":
        return block_tokens
    if setting == "auto":
        if not policy_interval:
            return 0
        return max(1, round(policy_interval / block_tokens)) * block_tokens
    assert isinstance(setting, int)
    if setting % block_tokens:
        raise ConfigError(
            f"vllm_hybrid: snapshot_every {setting} must be a multiple of the block size "
            f"({block_tokens} tokens)"
        )
    return setting
