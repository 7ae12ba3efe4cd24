"""Cache breakpoints and prewarming against a running `vllm-hybrid serve` (see docs/serving.md).

    vllm-hybrid serve models/tiny-zamba2 --served-model-name tiny --enable-prefix-caching \
        --enable-prompt-tokens-details --dtype float32 &
    python examples/breakpoints_prewarm.py --base-url http://127.0.0.1:8000 --model tiny

1. Prewarm: ``POST /v1/hybrid/prewarm`` computes a system prompt and pins it for two minutes;
   the very first conversation that starts with it is served from cache.
2. Breakpoint: a ``cache_control`` mark on another system prompt makes the server keep the
   model's recurrent state at its end, so a *second* conversation with the same system prompt
   hits there on its first turn (without the mark a hybrid model keeps no state there).
3. Cache report: ``vllm_xargs: {"cache_report": 1}`` returns what the cache did and why, in the
   response's ``kv_transfer_params``.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import httpx
from openai import OpenAI

SUPPORT = "You answer questions about our hardware store, briefly and politely. " * 12
TOOLS = "Tools: search(query), stock(item), aisle(item), order(item, quantity). " * 12
ORDERS = " ".join(
    f"order {i}: {i % 7 + 1} boxes of screws, {i % 3 + 1} brushes;" for i in range(12)
)
QUESTIONS = [f"My orders: {ORDERS} Where are the drills?", f"Orders: {ORDERS} Any seeds?"]


def ask(client: OpenAI, model: str, system: dict[str, Any], question: str) -> tuple[int, dict]:
    reply = client.chat.completions.create(
        model=model,
        messages=[system, {"role": "user", "content": question}],
        max_tokens=16,
        temperature=0.0,
        extra_body={"vllm_xargs": {"cache_report": 1}},
    )
    hybrid = (reply.model_extra.get("kv_transfer_params") or {}).get("vllm_hybrid", {})
    return reply.usage.prompt_tokens_details.cached_tokens, hybrid.get("cache_report", {})


def main(base_url: str, model: str) -> dict[str, Any]:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="none")
    results: dict[str, Any] = {}

    # 1. Prewarm the support system prompt, then the first real request hits.
    support = {"role": "system", "content": SUPPORT}
    pin = httpx.post(
        f"{base_url}/v1/hybrid/prewarm",
        json={"model": model, "messages": [support], "ttl_s": 120},
        timeout=300,
    ).json()
    print(f"prewarm: pinned {pin['pinned_tokens']} tokens in {pin['pinned_pages']} pages")
    cached, _ = ask(client, model, support, QUESTIONS[0])
    print(f"first request after prewarm: {cached} cached tokens")
    results.update(pinned_tokens=pin["pinned_tokens"], first_after_prewarm=cached)

    # 2. A breakpoint on the tools system prompt: the second conversation hits there.
    marked = {"role": "system", "content": TOOLS, "cache_control": {"type": "ephemeral"}}
    cached_first, report = ask(client, model, marked, QUESTIONS[0])
    cached_second, report_second = ask(
        client, model, {"role": "system", "content": TOOLS}, QUESTIONS[1]
    )
    print(
        f"breakpoint at token {report['breakpoints']}: conversation 1 cached {cached_first}, "
        f"conversation 2 cached {cached_second}"
    )
    print("cache report of conversation 2:", json.dumps(report_second, indent=1))
    results.update(
        breakpoint=report["breakpoints"][0],
        second_conversation=cached_second,
        report=report_second,
    )
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    main(args.base_url, args.model)
