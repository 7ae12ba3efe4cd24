"""``learned``: ``flop`` with ``P(another hit)`` learned online from the cache's own outcomes.

``flop`` (``core/flop.py``) ranks an entry by ``clock + (hits + 1) * P * (eff / eff_ref) **
gamma``, with ``P`` from counts per hit count or per inserter class. Here ``P`` is the estimate
of one tiny online logistic regression (stdlib only, sparse one-hot features) of
``P(the next reuse of this state comes before it is evicted)``, in the spirit of "Learning
Relaxed Belady" (LRB, NSDI'20), trained from what the cache observes:

* a **hit** on a live state is a positive example, with the features it had before the hit;
* an **eviction** leaves a ghost (the key and its features); a later request whose prompt
  holds the ghost's key deeper than its real hit makes it a (late) positive: had the state been
  kept, the request would have resumed there. A ghost that falls off the list (it holds at
  most as many keys as the index holds entries: the "boundary", as LRB's is the cache size)
  is a negative.

Features (one-hot buckets, so the model is a sum of looked-up weights, ~10 per estimate):
hits so far (0-3+) crossed with branch point (two or more continuations) and leaf; log2 of the
depth; log2 of the FLOPs saved per byte over the reference; the inserter's class (did it
resume from a hit, log2 of its content depth, as ``flop`` learns it); log2 of the KV accesses
of the block (requests whose path went through it, hit or not); log2 of the requests from
insertion to the last hit; log2 of the last gap between hits (the path's inter-arrival);
log2 of the parent's KV accesses (how busy the path it extends is).

Nothing is tuned per trace: the weights start at 0 (``P = 1/2``), AdaGrad with one fixed step
(:data:`LEARNING_RATE`) for every trace and shape; the ghost window is the index's size.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable
from typing import ClassVar

from vllm_hybrid.core.cost import CostModel
from vllm_hybrid.core.flop import FlopPolicy
from vllm_hybrid.core.node import Node
from vllm_hybrid.core.policy import AdmitContext

#: AdaGrad's step, the same for every trace and shape (not tuned per workload).
LEARNING_RATE = 0.5
#: A ghost waits this many mean residences for its reuse (the same for every trace and shape).
HORIZON_RESIDENCES = 1.0
_HITS_CAP = 3
_LOG_SLOTS = 40  # log2 buckets per numeric feature (clipped)

# Feature blocks: offsets into one weight vector.
_F_BIAS = 0
_F_HITS = 1  # (min(k, 3), branch, leaf): 4 * 2 * 2
_F_DEPTH = _F_HITS + 16
_F_EFF = _F_DEPTH + _LOG_SLOTS  # log2(eff / eff_ref) + 20
_F_CLASS = _F_EFF + _LOG_SLOTS  # flop's inserter class (2 * 32), + 1 unknown
_F_KV = _F_CLASS + 65
_F_AGE = _F_KV + _LOG_SLOTS  # slot 0: never hit / unknown origin
_F_GAP = _F_AGE + _LOG_SLOTS + 1
_F_PARENT = _F_GAP + _LOG_SLOTS + 1
_N_FEATURES = _F_PARENT + _LOG_SLOTS


def _log_slot(x: float) -> int:
    """Bucket of a non-negative count: 0 for 0, else 1 + floor(log2(x)), clipped."""
    if x < 1:
        return 0
    return min(int(x).bit_length(), _LOG_SLOTS - 1)


class GhostLabels:
    """Ghosts of evicted states, key -> features, oldest first; bounded by the entries held."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ghosts: OrderedDict[Hashable, tuple[int, tuple[int, ...], int]] = OrderedDict()
        self._ends: dict[int, dict[int, int]] = {}  # block index -> {offset: count}

    def __len__(self) -> int:
        return len(self._ghosts)

    def add(self, key: Hashable, end_tokens: int, x: tuple[int, ...], now: int) -> None:
        """Remember a victim evicted at request ``now``."""
        old = self._ghosts.pop(key, None)
        if old is not None:
            self._forget(old[0])
        self._ghosts[key] = (end_tokens, x, now)
        i, n = divmod(end_tokens, self.block_tokens)
        slot = self._ends.setdefault(i, {})
        slot[n] = slot.get(n, 0) + 1

    def expire(self, before: float) -> list[tuple[int, ...]]:
        """Drop the ghosts evicted before request ``before``; their features (negatives)."""
        expired = []
        ghosts = self._ghosts
        while ghosts:
            key = next(iter(ghosts))
            end, fx, when = ghosts[key]
            if when >= before:
                break
            del ghosts[key]
            self._forget(end)
            expired.append(fx)
        return expired

    def _forget(self, end_tokens: int) -> None:
        i, n = divmod(end_tokens, self.block_tokens)
        slot = self._ends[i]
        slot[n] -= 1
        if not slot[n]:
            del slot[n]
            if not slot:
                del self._ends[i]

    def take_hits(self, ctx: AdmitContext) -> list[tuple[int, ...]]:
        """Ghosts on the request's prompt path deeper than its real hit: removed, returned."""
        b, limit, hit = self.block_tokens, ctx.prompt_tokens - 1, ctx.hit_tokens
        out = []
        ends, ghosts = self._ends, self._ghosts
        if not ends:
            return out
        for i in range(limit // b, hit // b - 1, -1):
            slot = ends.get(i)
            if slot is None:
                continue
            for n in list(slot):
                if not hit < i * b + n <= limit or (n and ctx.probe is None):
                    continue
                key = ctx.probe(i, n) if n and ctx.probe is not None else ctx.key_at(i * b)
                got = ghosts.pop(key, None)
                if got is not None:
                    self._forget(got[0])
                    out.append(got[1])
        return out


class LearnedPolicy(FlopPolicy):
    """``flop`` whose ``P(another hit)`` is an online logistic regression of "reused before it
    is evicted", labelled by hits (positive) and ghosts of evicted states (a later request
    through the ghost's key: positive; the ghost aged out: negative). Admission as ``flop``."""

    name: ClassVar[str] = "learned"

    def __init__(self, cost: CostModel, overhead: float = 0.25) -> None:
        super().__init__(cost, overhead)
        self.weights = [0.0] * _N_FEATURES
        self._grad_sq = [1e-6] * _N_FEATURES
        self.ghost_labels = GhostLabels(self.block_tokens)
        self._last_hit: dict[Hashable, tuple[int, int]] = {}  # key -> (time, gap) of last hit
        self.examples = [0, 0]  # negatives, positives seen
        # Residence of evicted states (requests from insertion to eviction), for the horizon.
        self._evictions = 0
        self._sum_residence = 0.0
        self._log_ref = self.balance.log_eff_ref

    # ----------------------------------------------------------------- features
    def features(self, node: Node, hits: int, kv_hits: int, snapshot_only: bool) -> tuple:
        """Active one-hot features of ``node`` as it stands after ``hits`` state hits."""
        kids = len(node.children) + (sum(map(len, node.partials.values())) if node.partials else 0)
        k = min(hits, _HITS_CAP)
        x = [
            _F_BIAS,
            _F_HITS + 4 * k + 2 * (kids >= 2) + (kids == 0),
            _F_DEPTH + _log_slot(node.end_tokens),
        ]
        eff = self._efficiency(node, snapshot_only)
        le = math.log2(eff) - self._log_ref / math.log(2) if eff > 0 else -20.0
        x.append(_F_EFF + min(max(int(le + 20.5), 0), _LOG_SLOTS - 1))
        origin = node.origin
        cls = self._class_of.get(origin) if origin >= 0 else None
        x.append(_F_CLASS + (64 if cls is None else cls))
        x.append(_F_KV + _log_slot(kv_hits))
        last = self._last_hit.get(node.key)
        if hits and last is not None and origin >= 0:
            x.append(_F_AGE + 1 + _log_slot(last[0] - origin))
            x.append(_F_GAP + 1 + _log_slot(last[1]))
        else:
            x.append(_F_AGE)
            x.append(_F_GAP)
        parent = node.parent
        x.append(_F_PARENT + _log_slot(parent.hits if parent is not None else 0))
        return tuple(x)

    def predict(self, x: tuple[int, ...]) -> float:
        w = self.weights
        z = 0.0
        for i in x:
            z += w[i]
        if z >= 0:
            return 1.0 / (1.0 + math.exp(-min(z, 50.0)))
        e = math.exp(max(z, -50.0))
        return e / (1.0 + e)

    def learn(self, x: tuple[int, ...], label: int) -> None:
        """One AdaGrad step of the log loss on one example."""
        g = self.predict(x) - label
        self.examples[label] += 1
        w, gs = self.weights, self._grad_sq
        gg = g * g
        for i in x:
            gs[i] += gg
            w[i] -= LEARNING_RATE * g / math.sqrt(gs[i])

    # ----------------------------------------------------------------- learning
    def observe(self, ctx: AdmitContext, hit_node: Node) -> None:
        # Labels first, with the model and classes as they were when the states were ranked.
        now = ctx.request_index
        for x in self.ghost_labels.take_hits(ctx):
            self.learn(x, 1)
        for x in self.ghost_labels.expire(now - self.horizon):
            self.learn(x, 0)
        if ctx.hit_tokens and hit_node.has_snapshot:
            k = hit_node.snap_hits  # the index counted this hit already
            before = self.features(hit_node, max(k - 1, 0), max(hit_node.hits - 1, 0), False)
            self.learn(before, 1)
            prev = self._last_hit.get(hit_node.key)
            since = prev[0] if prev is not None else max(hit_node.origin, 0)
            self._last_hit[hit_node.key] = (ctx.request_index, ctx.request_index - since)
        super().observe(ctx, hit_node)

    def on_evicted(self, node: Node, snapshot_only: bool, live_entries: int) -> None:
        if node.has_snapshot:
            x = self.features(node, node.snap_hits, node.hits, snapshot_only)
            now = self._now
            self.ghost_labels.add(node.key, node.end_tokens, x, now)
            if node.origin >= 0:
                self._evictions += 1
                self._sum_residence += max(now - node.origin, 0)
            self._last_hit.pop(node.key, None)
        super().on_evicted(node, snapshot_only, live_entries)

    @property
    def horizon(self) -> float:
        """How long a ghost waits for its reuse: the mean residence of evicted states (the
        time the cache gives an entry; a reuse within one more such span is one a cache that
        kept it longer would have served). Before any eviction: forever."""
        if not self._evictions:
            return float("inf")
        return max(1.0, HORIZON_RESIDENCES * self._sum_residence / self._evictions)

    # ----------------------------------------------------------------- ranking
    def reuse_probability(self, node: Node) -> float:
        """Learned P(the next reuse comes before eviction)."""
        return self.predict(self.features(node, node.snap_hits, node.hits, not node.is_leaf))
