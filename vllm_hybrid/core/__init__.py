"""The core: engine-agnostic, standard library only (no torch, no vLLM).

The public API below is what the adapters, the serving layer, the simulator and the benchmarks
use; the submodules are the implementation (tests may reach into them).

* the prefix index (:class:`PrefixIndex`, ``core/index/``): which page holds which block key
  and state snapshot, what a request resumes from, which free pages go first;
* the policies (:data:`POLICIES`, ``core/policies.py``) under their contract
  (``core/policy.py``), the cost model (:class:`CostModel`) and model shapes;
* the router's decision across replicas (:class:`StateRouter`, ``core/router.py``);
* the engine-side state the adapter keeps per engine: the request feed, the host tier's ledger,
  pins, cache reports, per-request cache options, metrics and settings.
"""

from vllm_hybrid.core.breakpoints import (
    MAX_BREAKPOINTS,
    PIN_TTL,
    REPORT,
    CacheOptionError,
    CacheOptions,
    common_prefix_tokens,
    effective_breakpoints,
    hit_position,
    merge_breakpoints,
    prewarm_prompt,
)
from vllm_hybrid.core.cache_report import ReuseHistory
from vllm_hybrid.core.cache_stats import (
    KV,
    METRICS,
    PREFIX,
    SNAPSHOT,
    CounterDeltas,
    PageCounts,
    engine_totals,
)
from vllm_hybrid.core.config import STOCK, ConfigError, HybridCacheConfig, periodic_interval
from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.feed import RequestFeed
from vllm_hybrid.core.host_ledger import DEMOTE, PROMOTE, HostLedger, HostOp, host_slots
from vllm_hybrid.core.host_tier import HostTier, HostTierError
from vllm_hybrid.core.index import HiddenFn, IsFree, PageKey, PrefixIndex, ProbeFn, VictimStats
from vllm_hybrid.core.modules import IMPORT_KEY, ModuleError, ModuleSchema, boundaries
from vllm_hybrid.core.node import Match, Node
from vllm_hybrid.core.pins import DEFAULT_TTL_S, PinLedger, PrewarmRequest
from vllm_hybrid.core.policies import (
    POLICIES,
    BeladyOracle,
    BeladyPolicy,
    EngineAdmission,
    InfinitePolicy,
    MarconiPolicy,
)
from vllm_hybrid.core.policy import (
    AdmissionPolicy,
    AdmitContext,
    EvictionPolicy,
    exact_junction_stop,
    optional_snapshots_fit,
    output_state_position,
    prompt_end_stop,
    prompt_floor_stop,
)
from vllm_hybrid.core.router import (
    ReplicaLoad,
    ReplicaView,
    RouteDecision,
    StateRouter,
    power_of_two,
)
from vllm_hybrid.core.sglang import MAMBA_FULL_MEMORY_RATIO, pool_split_bytes
from vllm_hybrid.core.shapes import (
    ModelShape,
    ShapeError,
    builtin_shape_names,
    load_shape,
    shape_name_for_model_type,
)
from vllm_hybrid.core.siblings import (
    Sibling,
    SiblingWaits,
    shared_hash_units,
    sibling_stop,
    sibling_stops,
)

__all__ = [
    "DEFAULT_TTL_S",
    "DEMOTE",
    "IMPORT_KEY",
    "KV",
    "MAMBA_FULL_MEMORY_RATIO",
    "MAX_BREAKPOINTS",
    "METRICS",
    "PIN_TTL",
    "POLICIES",
    "PREFIX",
    "PROMOTE",
    "REPORT",
    "SNAPSHOT",
    "STOCK",
    "AdmissionPolicy",
    "AdmitContext",
    "BeladyOracle",
    "BeladyPolicy",
    "CacheOptionError",
    "CacheOptions",
    "ConfigError",
    "CostModel",
    "CounterDeltas",
    "EngineAdmission",
    "EvictionPolicy",
    "HiddenFn",
    "HostLedger",
    "HostOp",
    "HostTier",
    "HostTierError",
    "HybridCacheConfig",
    "InfinitePolicy",
    "IsFree",
    "MarconiPolicy",
    "Match",
    "ModelShape",
    "ModuleError",
    "ModuleSchema",
    "Node",
    "PageCounts",
    "PageKey",
    "PinLedger",
    "PrefixIndex",
    "PrewarmRequest",
    "ProbeFn",
    "ReplicaLoad",
    "ReplicaView",
    "RequestFeed",
    "ReuseHistory",
    "RouteDecision",
    "ShapeError",
    "StateRouter",
    "VictimStats",
    "boundaries",
    "builtin_shape_names",
    "common_prefix_tokens",
    "effective_breakpoints",
    "engine_totals",
    "hit_position",
    "host_slots",
    "load_shape",
    "merge_breakpoints",
    "exact_junction_stop",
    "optional_snapshots_fit",
    "output_state_position",
    "prompt_end_stop",
    "prompt_floor_stop",
    "shared_hash_units",
    "sibling_stop",
    "sibling_stops",
    "Sibling",
    "SiblingWaits",
    "periodic_interval",
    "pool_split_bytes",
    "power_of_two",
    "prewarm_prompt",
    "shape_name_for_model_type",
]
