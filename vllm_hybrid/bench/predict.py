"""What the simulator predicts for a replayed row: same requests, budget, block size and costs.

The engine row reports its pool layout (:class:`PoolLayout`); the simulator (``sim/replay.py``)
then replays the very token ids the engine saw, in arrival order, one request at a time, with
the same policy object the engine's scheduler ran (``stock`` is modelled by the ``vllm`` policy,
vLLM's align mode), bytes counted in the engine's pages and a budget of the engine's whole pool.

Expected differences, all making the engine's hit rate *lower*: the engine's pool also holds the
blocks of requests in flight (the simulator holds one request's at a time); requests that arrive
together cannot reuse each other's states (vLLM's Mamba manager refuses blocks cached in the same
step); a prompt's state is kept at its last full ``hash_tokens`` boundary below the prompt end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from vllm_hybrid.bench.workload import BenchRequest
from vllm_hybrid.core.config import STOCK
from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.policies import POLICIES
from vllm_hybrid.core.shapes import load_shape, shape_name_for_model_type
from vllm_hybrid.sim.replay import replay
from vllm_hybrid.sim.trace import KeyedRequest, SimRequest

#: The simulator's model of each bench row that is not a core policy name.
SIM_POLICY = {STOCK: "vllm"}


@dataclass(frozen=True)
class PoolLayout:
    """An engine's KV pool as the cost model sees it: one page per group per block."""

    blocks: int
    block_tokens: int
    page_bytes: int
    kv_groups: int
    state_groups: int
    model_type: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> PoolLayout:
        return cls(**obj)

    def cost_model(self) -> CostModel:
        shape = load_shape(shape_name_for_model_type(self.model_type))
        kv, state = self.kv_groups * self.page_bytes, self.state_groups * self.page_bytes
        return CostModel.from_pages(shape, self.block_tokens, kv, state)


def sim_requests(reqs: Sequence[BenchRequest], block_tokens: int) -> list[SimRequest]:
    """The prompts as simulator requests: one segment per block of token ids (its content id is
    the hash of those ids), so two prompts share block keys exactly when they share the block's
    token prefix, as in the engine. Outputs are not cached content: the engine's outputs never
    reappear in later prompts of a replay. The last partial block is not matchable (its state
    is kept only at a block boundary)."""
    out: list[SimRequest] = []
    for r in reqs:
        ids = r.prompt_token_ids
        blocks = [ids[i : i + block_tokens] for i in range(0, len(ids), block_tokens)]
        segments = tuple((hash(block), len(block)) for block in blocks)
        out.append(
            SimRequest(r.arrival_s * 1000.0, segments, len(ids), r.max_tokens, exact_end=False)
        )
    return out


def predict_hit_rate(reqs: Sequence[BenchRequest], layout: PoolLayout, policy: str) -> float | None:
    """The simulator's token hit rate for row ``policy`` (None for rows it cannot model)."""
    name = SIM_POLICY.get(policy, policy)
    if name not in POLICIES:
        return None
    cost = layout.cost_model()
    keyed = [KeyedRequest(r, layout.block_tokens) for r in sim_requests(reqs, layout.block_tokens)]
    stats = replay(keyed, cost, POLICIES[name](cost), layout.blocks * layout.page_bytes)
    return stats.token_hit_rate
