"""ARC-style ghosts that set the balance between recency and value in ``flop``'s priority.

``flop`` ranks an entry by ``clock + weight * (eff / eff_ref) ** gamma`` (GreedyDual): with
``gamma = 1`` by compute saved per byte (value), with ``gamma = 0`` by the clock of its last use
alone (recency). :class:`GhostBalance` learns ``gamma`` online, as ARC learns the split between
its recency and frequency lists, starting from the middle (no prior for either):

* every eviction is classed by what made it. A victim used more recently than the average
  victim went because it was cheap: a *value* eviction, one recency would not have made. A
  victim more efficient (log FLOPs per byte) than the average victim went because it was old: a
  *recency* eviction, one value would not have made. Victims both orders (or neither) would
  evict are not remembered;
* the victim's key is kept as a ghost of its class; the two lists together hold at most as many
  keys as the index holds entries (the oldest ghost of the longer list goes first);
* a later request whose prompt holds a ghost's key deeper than its real hit is a ghost hit: a
  hit on a value ghost moves ``gamma`` towards recency, a hit on a recency ghost towards value,
  by ARC's step ``max(1, |other| / |this|) / capacity``, scaled by the ghost's efficiency over
  the average victim's (entries differ in size and worth; ARC's pages do not).

Nothing is tuned: ``eff_ref`` only fixes the unit, the averages are over all evictions so far.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Hashable

from vllm_hybrid.core.policy import AdmitContext

RECENCY, VALUE = 0, 1  # what made the eviction (the class of the ghost)
ProbeFn = Callable[[int, int], Hashable]


class GhostBalance:
    """Online ``gamma`` in [0, 1] from hits on ghosts of evicted entries; bounded state."""

    def __init__(self, block_tokens: int, eff_ref: float, gamma: float = 0.5) -> None:
        self.block_tokens = block_tokens
        self.log_eff_ref = math.log(max(eff_ref, 1e-300))
        self.gamma = gamma
        self.capacity = 1
        self.ghost_hits = [0, 0]
        # key -> (end_tokens, log efficiency at eviction), oldest first, one list per class
        self._ghosts: tuple[OrderedDict[Hashable, tuple[int, float]], ...] = (
            OrderedDict(),
            OrderedDict(),
        )
        # ghost ends by block: {block index i: {n: count}} for ends at i * block_tokens + n
        self._ends: dict[int, dict[int, int]] = {}
        self._n = 0
        self._sum_log_eff = 0.0
        self._sum_age = 0.0

    @property
    def mean_log_eff(self) -> float:
        return self._sum_log_eff / self._n if self._n else self.log_eff_ref

    def scale(self, eff: float) -> float:
        """``(eff / eff_ref) ** gamma``: the value term of a priority."""
        if eff <= 0.0:
            return 0.0
        return math.exp(self.gamma * (math.log(eff) - self.log_eff_ref))

    def __len__(self) -> int:
        return sum(len(g) for g in self._ghosts)

    # ----------------------------------------------------------------- evictions
    def on_evicted(self, key: Hashable, end_tokens: int, eff: float, age: int, live: int) -> None:
        """Class one eviction and keep its ghost; ``live`` (entries held) bounds the lists."""
        log_eff = math.log(eff) if eff > 0.0 else self.mean_log_eff
        mean_age = self._sum_age / self._n if self._n else float(age)
        young, valuable = age < mean_age, log_eff > self.mean_log_eff
        self._n += 1
        self._sum_log_eff += log_eff
        self._sum_age += age
        self.capacity = max(1, live)
        if young != valuable:
            self._remember(key, end_tokens, log_eff, VALUE if young else RECENCY)
        while len(self) > self.capacity:
            longer = max(self._ghosts, key=len)
            old_key, (old_end, _) = longer.popitem(last=False)
            self._forget_end(old_end)

    def _remember(self, key: Hashable, end_tokens: int, log_eff: float, cls: int) -> None:
        for ghosts in self._ghosts:
            if key in ghosts:
                self._forget_end(ghosts.pop(key)[0])
        self._ghosts[cls][key] = (end_tokens, log_eff)
        i, n = divmod(end_tokens, self.block_tokens)
        slot = self._ends.setdefault(i, {})
        slot[n] = slot.get(n, 0) + 1

    def _forget_end(self, end_tokens: int) -> None:
        i, n = divmod(end_tokens, self.block_tokens)
        slot = self._ends[i]
        slot[n] -= 1
        if not slot[n]:
            del slot[n]
            if not slot:
                del self._ends[i]

    # ----------------------------------------------------------------- requests
    def observe(self, ctx: AdmitContext) -> int | None:
        """Check a request against the ghosts; on a hit deeper than its real hit, move
        ``gamma`` and return the ghost's class (None: no ghost hit)."""
        found = self._deepest_ghost(ctx)
        if found is None:
            return None
        key, cls = found
        end, log_eff = self._ghosts[cls].pop(key)
        self._forget_end(end)
        self.ghost_hits[cls] += 1
        ratio = len(self._ghosts[1 - cls]) / max(len(self._ghosts[cls]), 1)
        step = max(1.0, ratio) / self.capacity * math.exp(log_eff - self.mean_log_eff)
        sign = 1.0 if cls == RECENCY else -1.0  # recency evicted it wrongly: more value
        self.gamma = min(1.0, max(0.0, self.gamma + sign * step))
        return cls

    def _deepest_ghost(self, ctx: AdmitContext) -> tuple[Hashable, int] | None:
        b, limit, hit = self.block_tokens, ctx.prompt_tokens - 1, ctx.hit_tokens
        ends = self._ends
        for i in range(limit // b, hit // b - 1, -1):
            if i not in ends:
                continue
            for n in sorted(ends[i], reverse=True):
                if not hit < i * b + n <= limit or (n and ctx.probe is None):
                    continue
                key = ctx.probe(i, n) if n and ctx.probe is not None else ctx.key_at(i * b)
                found = self._lookup(key)
                if found is not None:
                    return found
        return None

    def _lookup(self, key: Hashable) -> tuple[Hashable, int] | None:
        for cls, ghosts in enumerate(self._ghosts):
            if key in ghosts:
                return key, cls
        return None
