"""Multi-turn chat against a running `vllm-hybrid serve`, printing cached prompt tokens per turn.

    vllm-hybrid serve models/tiny-zamba2 --served-model-name tiny --enable-prefix-caching \
        --enable-prompt-tokens-details --dtype float32 &
    python examples/chat_client.py --base-url http://127.0.0.1:8000/v1 --model tiny

`cached_tokens` is vLLM's OpenAI-compatible `usage.prompt_tokens_details.cached_tokens`
(the server needs `--enable-prompt-tokens-details`).
"""

from __future__ import annotations

import argparse

from openai import OpenAI

TURNS = ["Hello! What can you do?", "Tell me about hybrid models.", "Why cache their state?"]


def main(base_url: str, model: str, system: str = "You are terse. " * 40) -> list[int]:
    client = OpenAI(base_url=base_url, api_key="none")
    messages = [{"role": "system", "content": system}]
    cached = []
    for turn, text in enumerate(TURNS, start=1):
        messages.append({"role": "user", "content": text})
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=24, temperature=0.0
        )
        details = reply.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details else 0)
        print(f"turn {turn}: prompt {reply.usage.prompt_tokens} tokens, {cached[-1]} cached")
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
    return cached


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1")
    parser.add_argument("--model", default="tiny")
    args = parser.parse_args()
    main(args.base_url, args.model)
