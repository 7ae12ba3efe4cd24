"""``vllm-hybrid advise``: what breaks prefix reuse in a log of prompts, and what a fix saves.

A prefix cache (and, for hybrid models, a recurrent-state snapshot) only helps while prompts
share a *prefix*. Two things commonly break it early in a prompt:

* **volatile content**: a timestamp, request id or counter near the top of a system prompt
  makes every prompt differ from the previous one right there, although everything after it is
  the same;
* **reordered tool definitions**: the same tool set rendered in another order.

For every prompt the advisor finds the earlier prompt sharing the longest token prefix. Where
that prefix ends it looks for a re-synchronisation: a short differing span after which both
prompts agree again for a long run. That span is a reuse breaker; the run after it is the
tokens a fix would let the cache serve. Standard library only; tokens are approximated by a
regex split unless a tokenizer is given.

Log format (JSON Lines), one request per line: ``{"prompt": "..."}`` or ``{"messages": [{"role":
..., "content": ...}], "tools": [{"function": {"name": ...}, ...}]}``.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from vllm_hybrid.core import common_prefix_tokens

Tokenize = Callable[[str], list[str]]
_TOKEN_RE = re.compile(r"\w+|[^\w\s]|\s+")
KINDS = [
    ("timestamp", re.compile(r"\d{4}-\d{2}-\d{2}|\d{1,2}:\d{2}(:\d{2})?")),
    ("identifier", re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}|[0-9a-f]{12,}", re.I)),
    ("number", re.compile(r"\d")),
]
#: how far past a break a re-synchronisation is looked for, and how long it must agree
MAX_SPAN_TOKENS, MIN_RUN_TOKENS = 48, 16


class LogError(ValueError):
    """A malformed log line (the message names the line)."""


@dataclass
class Prompt:
    line: int
    text: str
    tools: list[str] = field(default_factory=list)
    tools_text_end: int = 0  # characters of text taken by the rendered tools
    canonical_text: str = ""  # the same prompt with its tools sorted by name


@dataclass
class Breaker:
    kind: str
    line: int
    other_line: int
    position_tokens: int
    span_text: str
    saved_tokens: int


def regex_tokenize(text: str) -> list[str]:
    return _TOKEN_RE.findall(text)


def parse_line(raw: str, line: int) -> Prompt | None:
    if not raw.strip():
        return None
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise LogError(f"line {line}: not JSON ({exc.msg})") from None
    if not isinstance(obj, dict):
        raise LogError(f"line {line}: expected an object with 'prompt' or 'messages'")
    if isinstance(obj.get("prompt"), str):
        return Prompt(line, obj["prompt"], canonical_text=obj["prompt"])
    messages = obj.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise LogError(f"line {line}: needs a string 'prompt' or a list of 'messages'")
    raw_tools = obj.get("tools") or []
    if not isinstance(raw_tools, list):
        raise LogError(f"line {line}: 'tools' must be a list")
    tools = [_tool_name(t, line) for t in raw_tools]
    body = "".join(f"<{m.get('role', 'user')}>{m.get('content', '')}\n" for m in messages)
    tools_text = _render_tools(raw_tools)
    canonical = _render_tools(
        [t for _, t in sorted(zip(tools, raw_tools, strict=True), key=lambda nt: nt[0])]
    )
    return Prompt(line, tools_text + body, tools, len(tools_text), canonical + body)


def _render_tools(tools: list[object]) -> str:
    return "".join(f"<tool>{json.dumps(t, sort_keys=True)}</tool>\n" for t in tools)


def _tool_name(tool: object, line: int) -> str:
    if isinstance(tool, dict):
        fn = tool.get("function", tool)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return str(fn["name"])
    raise LogError(f"line {line}: every tool needs a name (tools[].function.name)")


def load_log(path: str) -> list[Prompt]:
    with open(path, encoding="utf-8") as handle:
        prompts = [parse_line(raw, i) for i, raw in enumerate(handle, start=1)]
    return [p for p in prompts if p is not None]


def resync(a: Sequence[str], b: Sequence[str], at: int) -> tuple[int, int, int] | None:
    """Smallest (skip_a, skip_b) after ``at`` where a and b agree again; with the run length."""
    for total in range(2, 2 * MAX_SPAN_TOKENS + 1):
        for skip_a in range(max(1, total - MAX_SPAN_TOKENS), min(total, MAX_SPAN_TOKENS + 1)):
            skip_b = total - skip_a
            run = common_prefix_tokens(a[at + skip_a :], b[at + skip_b :])
            if run >= MIN_RUN_TOKENS:
                return skip_a, skip_b, run
    return None


def classify(span: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(span):
            return kind
    return "varying text"


def best_previous(tokens: list[list[str]], i: int, window: int) -> tuple[int, int]:
    """The earlier prompt (within ``window``) with the longest common prefix, and its length."""
    best, best_len = -1, -1
    for j in range(max(0, i - window), i):
        n = common_prefix_tokens(tokens[i], tokens[j])
        if n > best_len:
            best, best_len = j, n
    return best, best_len


def find_breakers(
    prompts: list[Prompt], tokenize: Tokenize = regex_tokenize, window: int = 64
) -> tuple[list[Breaker], int, int]:
    """Breakers, total prompt tokens, and tokens a prefix cache could serve today."""
    tokens = [tokenize(p.text) for p in prompts]
    breakers, reusable = [], 0
    for i, prompt in enumerate(prompts):
        j, lcp = best_previous(tokens, i, window)
        if j < 0:
            continue
        reusable += lcp
        breaker = _breaker_at(prompt, prompts[j], tokens[i], tokens[j], lcp, tokenize)
        if breaker is not None:
            breakers.append(breaker)
    return breakers, sum(len(t) for t in tokens), reusable


def _breaker_at(
    prompt: Prompt, other: Prompt, a: list[str], b: list[str], lcp: int, tokenize: Tokenize
) -> Breaker | None:
    """What breaks the shared prefix of ``a`` (this prompt) and ``b`` (an earlier one) at lcp."""
    if _tools_reordered(prompt, other, len("".join(a[:lcp]))):
        saved = common_prefix_tokens(
            tokenize(prompt.canonical_text), tokenize(other.canonical_text)
        )
        return Breaker(
            "reordered tools", prompt.line, other.line, lcp, "".join(a[lcp : lcp + 8]), saved - lcp
        )
    found = resync(a, b, lcp)
    if found is None:
        return None
    skip, _, run = found
    span = "".join(a[lcp : lcp + skip])
    return Breaker(classify(span), prompt.line, other.line, lcp, span, run)


def _tools_reordered(prompt: Prompt, other: Prompt, at_chars: int) -> bool:
    return (
        bool(prompt.tools)
        and at_chars < prompt.tools_text_end
        and prompt.tools != other.tools
        and sorted(prompt.tools) == sorted(other.tools)
    )


def summarize(breakers: list[Breaker]) -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {}
    for b in breakers:
        row = out.setdefault(b.kind, {"count": 0, "saved_tokens": 0, "example": b})
        row["count"] = int(str(row["count"])) + 1
        row["saved_tokens"] = int(str(row["saved_tokens"])) + b.saved_tokens
    return out


def render(breakers: list[Breaker], total: int, reusable: int) -> str:
    lines = [
        f"prompt tokens: {total}; served from a prefix cache today: {reusable} "
        f"({reusable / max(total, 1):.1%})"
    ]
    if not breakers:
        return "\n".join(lines + ["no reuse breakers found"])
    lines.append(f"{'breaker':>16} {'count':>6} {'tokens saved by fixing':>23}  example")
    for kind, row in sorted(
        summarize(breakers).items(), key=lambda kv: -int(str(kv[1]["saved_tokens"]))
    ):
        ex = row["example"]
        assert isinstance(ex, Breaker)
        lines.append(
            f"{kind:>16} {row['count']:>6} {row['saved_tokens']:>23}  line {ex.line}, "
            f"token {ex.position_tokens}: {ex.span_text.strip()[:40]!r}"
        )
    saved = sum(b.saved_tokens for b in breakers)
    lines.append(
        f"fixing all: {reusable + saved} tokens ({(reusable + saved) / max(total, 1):.1%})"
    )
    return "\n".join(lines)


_WORDS = (
    "the cache keeps state for each prefix so that later requests resume instead of "
    "recomputing and the policy decides what stays when memory runs short"
).split()
_TOOLS = ["search_docs", "read_file", "run_tests", "open_ticket", "send_mail"]


def _stable_text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def generate_log(n_requests: int = 120, seed: int = 0) -> tuple[list[str], dict[str, int]]:
    """A JSONL log with planted reuse breakers; returns the lines and the planted counts."""
    rng = random.Random(seed)
    system = _stable_text(rng, 160)
    tools = [
        {"type": "function", "function": {"name": n, "description": _stable_text(rng, 12)}}
        for n in _TOOLS
    ]
    planted = {"timestamp": 0, "identifier": 0, "reordered tools": 0}
    seen_orders: set[tuple[str, ...]] = {tuple(_TOOLS)}  # the clean family's order
    lines = []
    for i in range(n_requests):
        question = f"question {i}: " + _stable_text(rng, 20)
        kind = ["timestamp", "identifier", "reordered tools", "clean"][i % 4]
        if kind == "timestamp":
            stamp = f"2026-11-{1 + i % 28:02d} {i % 24:02d}:{i % 60:02d}:{(7 * i) % 60:02d}"
            obj: dict[str, object] = {
                "messages": [
                    {"role": "system", "content": f"You are helpful. Now: {stamp}. {system}"},
                    {"role": "user", "content": question},
                ]
            }
        elif kind == "identifier":
            rid = f"{rng.getrandbits(128):032x}"
            obj = {
                "messages": [
                    {"role": "system", "content": f"You are helpful. Session {rid}. {system}"},
                    {"role": "user", "content": question},
                ]
            }
        else:
            order = list(tools)
            if kind == "reordered tools":
                rng.shuffle(order)
            obj = {
                "tools": order,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            }
        if kind == "reordered tools":
            order_names = tuple(str(t["function"]["name"]) for t in order)
            kind = kind if order_names not in seen_orders else "repeat"
            seen_orders.add(order_names)
        if kind in planted and i >= 4:  # the first of each family has nothing to reuse
            planted[kind] += 1
        lines.append(json.dumps(obj))
    return lines, planted


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="vllm-hybrid advise")
    parser.description = "Find what breaks prefix reuse in a JSONL log of prompts."
    parser.add_argument("log", nargs="?", help="JSONL log ({'prompt'} or {'messages','tools'})")
    parser.add_argument("--tokenizer", help="tokenizer directory (default: a regex word split)")
    parser.add_argument("--window", type=int, default=64, help="earlier prompts compared with")
    parser.add_argument("--json", dest="json_out", help="also write the breakers as JSON")
    parser.add_argument("--generate", metavar="OUT", help="write a log with planted breakers")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _tokenizer(path: str | None) -> Tokenize:
    if path is None:
        return regex_tokenize
    from transformers import AutoTokenizer  # optional dependency, only when asked for

    tok = AutoTokenizer.from_pretrained(path)
    return lambda text: [str(t) for t in tok.encode(text, add_special_tokens=False)]


def run(args: argparse.Namespace) -> int:
    if args.generate:
        lines, planted = generate_log(seed=args.seed)
        with open(args.generate, "w", encoding="utf-8") as handle:
            handle.write("\n".join(lines) + "\n")
        print(f"wrote {len(lines)} requests to {args.generate}; planted: {planted}")
        return 0
    if not args.log:
        print("advise: give a LOG file (or --generate OUT)", file=sys.stderr)
        return 2
    try:
        prompts = load_log(args.log)
    except (OSError, LogError) as exc:
        print(f"advise: {args.log}: {exc}", file=sys.stderr)
        return 2
    breakers, total, reusable = find_breakers(prompts, _tokenizer(args.tokenizer), args.window)
    print(render(breakers, total, reusable))
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as handle:
            json.dump([b.__dict__ for b in breakers], handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(run(build_parser().parse_args()))
