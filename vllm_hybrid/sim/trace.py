"""Simulated requests and the Mooncake trace reader.

A request's cacheable content is a sequence of *segments* ``(content_id, n_tokens)``: token
``k`` of a segment is the same token wherever the segment appears. Block keys are chained hashes
of the pieces ``(content_id, first, last)`` that fall in each block, so two requests share the
key of block ``i`` exactly when their first ``(i + 1) * block_tokens`` tokens are equal, at any
block size. Only ints are hashed, so keys are deterministic across processes.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A malformed trace line; the message names the file, the line number and the reason."""


@dataclass(frozen=True)
class SimRequest:
    """One request: arrival, prompt length, and the content it leaves in the cache.

    ``segments`` cover the prompt and, where a later turn is known to extend it, the output
    (then ``cacheable_tokens > prompt_tokens``). ``exact_end`` says whether the content of the
    last partial block is known, so an exact-position snapshot there can be matched later.
    """

    arrival_ms: float
    segments: tuple[tuple[int, int], ...]
    prompt_tokens: int
    output_tokens: int
    exact_end: bool = True

    @property
    def cacheable_tokens(self) -> int:
        return sum(n for _, n in self.segments)

    def shared_prompt_tokens(self, other: SimRequest) -> int:
        """How many leading prompt tokens this request shares with ``other``: their segments
        agree up to there (two segments of one content share their first tokens)."""
        n = 0
        for (ca, na), (cb, nb) in zip(self.segments, other.segments):  # noqa: B905
            if ca != cb:
                break
            n += min(na, nb)
            if na != nb:
                break
        return min(n, self.prompt_tokens, other.prompt_tokens)


class KeyedRequest:
    """A request with its block keys computed for one block size (shared by all runs)."""

    __slots__ = ("req", "block_tokens", "keys", "_starts", "_tail_key")

    def __init__(self, req: SimRequest, block_tokens: int) -> None:
        self.req = req
        self.block_tokens = block_tokens
        self._starts: list[int] = []
        total = 0
        for _, n in req.segments:
            self._starts.append(total)
            total += n
        n_full = total // block_tokens
        self.keys: list[int] = []
        prev = 0
        for i in range(n_full):
            prev = hash((prev, self._pieces(i * block_tokens, (i + 1) * block_tokens)))
            self.keys.append(prev)
        rem = total - n_full * block_tokens
        self._tail_key = self.probe(n_full, rem) if rem else None

    def _pieces(self, a_tokens: int, b_tokens: int) -> tuple[int, ...]:
        out: list[int] = []
        i = bisect.bisect_right(self._starts, a_tokens) - 1
        segs = self.req.segments
        while a_tokens < b_tokens:
            start = self._starts[i]
            cid, n = segs[i]
            end = min(b_tokens, start + n)
            out.extend((cid, a_tokens - start, end - start))
            a_tokens = end
            i += 1
        return tuple(out)

    def probe(self, block_index: int, n_tokens: int) -> int:
        """Key of the first ``n_tokens`` of block ``block_index`` (a partial block)."""
        prev = self.keys[block_index - 1] if block_index else 0
        a = block_index * self.block_tokens
        return hash((prev, -1, self._pieces(a, a + n_tokens)))

    def key_at(self, position_tokens: int) -> int | None:
        """Key of the node that ends at ``position_tokens`` (block boundary or exact end)."""
        if position_tokens % self.block_tokens == 0:
            return self.keys[position_tokens // self.block_tokens - 1]
        return self._tail_key if position_tokens == self.req.cacheable_tokens else None

    @property
    def tail_key(self) -> int | None:
        return self._tail_key


def _fail(path: Path, lineno: int, reason: str) -> TraceError:
    return TraceError(f"{path}:{lineno}: {reason}")


def _parse_mooncake_line(path: Path, lineno: int, line: str) -> SimRequest:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise _fail(path, lineno, f"invalid JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise _fail(path, lineno, "expected a JSON object")
    for name in ("timestamp", "input_length", "output_length", "hash_ids"):
        if name not in obj:
            raise _fail(path, lineno, f"missing field {name!r}")
    ts, n_in, n_out, ids = (
        obj["timestamp"],
        obj["input_length"],
        obj["output_length"],
        obj["hash_ids"],
    )
    if not isinstance(ts, (int, float)) or isinstance(ts, bool) or ts < 0:
        raise _fail(path, lineno, f"timestamp must be a number >= 0, got {ts!r}")
    for name, v in (("input_length", n_in), ("output_length", n_out)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise _fail(path, lineno, f"{name} must be an integer >= 0, got {v!r}")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in ids
    ):
        raise _fail(path, lineno, "hash_ids must be a list of integers")
    need = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != need:
        raise _fail(path, lineno, f"{len(ids)} hash_ids for input_length {n_in} (expected {need})")
    if n_in == 0:
        raise _fail(path, lineno, "input_length must be > 0")
    last = n_in - (need - 1) * MOONCAKE_BLOCK_TOKENS
    segs = [(h, MOONCAKE_BLOCK_TOKENS) for h in ids[:-1]] + [(ids[-1], last)]
    # Output content is unknown in this trace: it is not cacheable for later requests.
    return SimRequest(float(ts), tuple(segs), n_in, n_out, exact_end=False)


def iter_mooncake(path: str | Path, limit: int | None = None) -> Iterator[SimRequest]:
    """Requests of a Mooncake JSONL trace, in file order; blank lines are skipped."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"trace file not found: {path}")
    count = 0
    with path.open() as fh:
        for lineno, line in enumerate(fh, start=1):
            if limit is not None and count >= limit:
                return
            if not line.strip():
                continue
            yield _parse_mooncake_line(path, lineno, line)
            count += 1


def load_mooncake(path: str | Path, limit: int | None = None) -> list[SimRequest]:
    return list(iter_mooncake(path, limit))
