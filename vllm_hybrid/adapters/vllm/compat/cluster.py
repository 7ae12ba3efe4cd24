"""Everything the cluster (``vllm_hybrid/cluster/``) needs of vLLM 0.32.0: one replica's engine
and OpenAI app, what a router reads of it, and how the router hashes a prompt alike.

* :func:`start_engine_app` builds what ``vllm serve`` builds, in the calling process: an
  ``AsyncLLM`` from the CLI flags and vLLM's own FastAPI app around it
  (``vllm/entrypoints/launchers/api_server/entry.py::build_async_engine_client_from_engine_args``
  and ``run_server``'s ``build_app`` + ``init_app_state``), without a socket: a Serve replica
  calls the app through ASGI.

* :func:`install_route_digest` adds one utility method, ``vllm_hybrid_route_digest``, to
  ``EngineCore`` (``vllm/v1/engine/core.py``; utilities are called by name from the frontend,
  ``AsyncLLM.engine_core.call_utility_async``, and run in the engine core's busy loop between
  steps). It answers the replica's **state-bearing prefixes**: every key of the block pool's
  hash map (``cached_block_hash_to_block``) in a recurrent (``MambaSpec``) group, truncated to
  8 bytes, plus the KV keys of the attention groups and the scheduler's load. A key of vLLM's
  map is the chained hash of the whole prefix up to a ``hash_block_size`` boundary (full
  blocks and partial entries alike: ``BlockHashListWithBlockSize``,
  ``BlockPool._get_partial_block_hash``), so a router that hashes a prompt the same way finds
  the deepest position where the replica holds a state by set membership.
* :func:`prompt_hashes` hashes token ids as the engine does (``get_request_block_hasher`` on a
  ``Request`` with the request's ``cache_salt``), given the digest's ``hash_block_size`` and
  algorithm. The router checks the digest's ``none_hash`` against its own: they agree across
  processes for the default ``sha256`` (vLLM seeds it with a fixed string) or when every
  process has the same ``PYTHONHASHSEED``; on a mismatch the digest is unusable and the router
  says so.
"""

from __future__ import annotations

import time
from typing import Any

DIGEST_METHOD = "vllm_hybrid_route_digest"
KEY_BYTES = 8


def key_of(block_hash: bytes) -> int:
    """The router's key for one of vLLM's block hashes: its first 8 bytes as an int."""
    return int.from_bytes(bytes(block_hash)[:KEY_BYTES], "little")


def _route_digest(self: Any, max_keys: int = 1 << 20) -> dict[str, Any]:
    """(Bound to ``EngineCore``.) The replica's cached keys per group kind and its load."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.kv_cache_utils import get_block_hash, get_group_id
    from vllm.v1.kv_cache_interface import MambaSpec

    from vllm_hybrid.adapters.vllm.config import pool_layout

    sched = self.scheduler
    layout = getattr(self, "_vllm_hybrid_layout", None)
    if layout is None:  # fixed for the engine's life: computed once, not every push
        layout = pool_layout(sched, self.vllm_config.model_config.hf_config)
        self._vllm_hybrid_layout = layout
    manager = sched.kv_cache_manager
    pool = manager.block_pool
    groups = sched.kv_cache_config.kv_cache_groups
    recurrent = {i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, MambaSpec)}
    states: set[int] = set()
    kv: set[int] = set()
    for key in list(pool.cached_block_hash_to_block._cache):
        (states if get_group_id(key) in recurrent else kv).add(key_of(get_block_hash(key)))
        if len(states) + len(kv) >= max_keys:
            break
    waiting = list(sched.waiting)
    prefill_left = [
        max(r.num_prompt_tokens - r.num_computed_tokens, 0) for r in waiting + list(sched.running)
    ]
    none_hash = getattr(kv_cache_utils, "NONE_HASH", None)
    return {
        "taken_at": time.time(),
        "hash_block_size": int(sched.hash_block_size),
        "block_size": int(sched.block_size),
        "hash_algo": str(self.vllm_config.cache_config.prefix_caching_hash_algo),
        "none_hash": None if none_hash is None else bytes(none_hash).hex(),
        "states": sorted(states),
        "kv": sorted(kv),
        "waiting": len(waiting),
        "running": len(sched.running),
        "queued_prefill_tokens": int(sum(prefill_left)),
        "free_pages": int(pool.get_num_free_blocks()),
        "layout": layout,
    }


def install_route_digest() -> bool:
    """Add ``EngineCore.vllm_hybrid_route_digest`` (idempotent; every process may call it,
    only the engine core's busy loop ever runs it)."""
    from vllm.v1.engine.core import EngineCore

    if getattr(EngineCore, DIGEST_METHOD, None) is _route_digest:
        return False
    setattr(EngineCore, DIGEST_METHOD, _route_digest)
    return True


async def start_engine_app(model: str, flags: list[str]) -> tuple[Any, Any]:
    """(``AsyncLLM``, vLLM's OpenAI ASGI app) for ``vllm serve MODEL FLAGS...``."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.engine.async_llm import AsyncLLM

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", model, *flags])
    engine_args = AsyncEngineArgs.from_cli_args(args)
    config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    engine = AsyncLLM.from_vllm_config(
        vllm_config=config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        disable_log_stats=engine_args.disable_log_stats,
    )
    tasks = await engine.get_supported_tasks()
    app = build_app(args, tasks, engine.model_config)
    await init_app_state(engine, app.state, args, tasks)
    return engine, app


async def route_digest(engine: Any) -> dict[str, Any]:
    """The digest of an ``AsyncLLM``'s engine core (a utility call, answered between steps)."""
    return dict(await engine.engine_core.call_utility_async(DIGEST_METHOD))


_HASHERS: dict[tuple[int, str], Any] = {}


def local_none_hash(algo: str) -> str:
    """This process's ``NONE_HASH`` for ``algo`` (initialised as the engine core does)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils

    if getattr(kv_cache_utils, "NONE_HASH", None) is None:
        kv_cache_utils.init_none_hash(get_hash_fn_by_name(algo))
    return bytes(kv_cache_utils.NONE_HASH).hex()


def prompt_hashes(
    token_ids: list[int], cache_salt: str | None, hash_block_size: int, algo: str
) -> list[int]:
    """The router keys of ``token_ids``' prefixes at every ``hash_block_size`` boundary
    (``[i]`` names tokens ``[0, (i + 1) * hash_block_size)``), as the engine hashes them."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    local_none_hash(algo)
    hasher = _HASHERS.get((hash_block_size, algo))
    if hasher is None:
        hasher = get_request_block_hasher(hash_block_size, get_hash_fn_by_name(algo))
        _HASHERS[(hash_block_size, algo)] = hasher
    request = Request(
        request_id="route",
        prompt_token_ids=list(token_ids),
        sampling_params=SamplingParams(max_tokens=1),
        pooling_params=None,
        cache_salt=cache_salt,
        block_hasher=hasher,
    )
    return [key_of(h) for h in request.block_hashes]
