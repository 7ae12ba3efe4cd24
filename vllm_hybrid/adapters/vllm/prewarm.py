"""Prewarming for offline ``LLM(...)`` users (vLLM 0.32.0): compute a prefix and pin it.

    from vllm import LLM
    from vllm_hybrid.adapters.vllm.prewarm import prewarm

    llm = LLM(model=MODEL, enable_prefix_caching=True)
    pin = prewarm(llm, messages=[{"role": "system", "content": SYSTEM}], ttl_s=600)
    pin["tokens"]  # a later request starting with this prefix hits exactly this many tokens

The prefix (and one token more: ``core/breakpoints.py::prewarm_prompt``, so the pinned state
is at the prefix's end) runs as a one-token generation whose ``SamplingParams.extra_args`` carry
``cache_pin_ttl_s``; the engine core pins its cached blocks when it finishes
(``cache_control.py``) and answers in ``RequestOutput.kv_transfer_params["vllm_hybrid"]``.
The HTTP twin is ``POST /v1/hybrid/prewarm`` (``serving.py``). Breakpoints for ``LLM(...)``
need no helper: ``SamplingParams(extra_args={"cache_breakpoints": [N]})``.
"""

from __future__ import annotations

from typing import Any

from vllm_hybrid.core import (
    DEFAULT_TTL_S,
    PIN_TTL,
    REPORT,
    CacheOptionError,
    PrewarmRequest,
    prewarm_prompt,
)


class PinRefusedError(CacheOptionError):
    """The engine computed the prefix but did not pin it (the message says why)."""


def prewarm(
    llm: Any,
    prompt: str | list[int] | None = None,
    *,
    messages: list[Any] | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    cache_salt: str | None = None,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Compute ``prompt`` (text or token ids) or the chat prefix ``messages`` (rendered with
    the model's chat template, no generation prompt) in ``llm``'s engine and pin its cached
    blocks for ``ttl_s`` seconds. Returns the engine's pin record (``tokens``: the prefix a
    later request hits, ``pages``, ``expires_in_s``, ...); raises :class:`PinRefusedError`
    when the pin does not fit (``max_pinned_fraction``) and ``CacheOptionError`` on bad input."""
    from vllm import SamplingParams

    body: dict[str, Any] = {"ttl_s": ttl_s}
    body.update({"prompt": prompt} if messages is None else {"messages": messages})
    if chat_template_kwargs is not None:
        body["chat_template_kwargs"] = chat_template_kwargs
    request = PrewarmRequest.parse(body)
    tokenizer = llm.get_tokenizer()
    if request.messages is not None:
        text = tokenizer.apply_chat_template(
            request.messages,
            tokenize=False,
            add_generation_prompt=False,
            **(chat_template_kwargs or {}),
        )
        tokens = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(request.prompt, str):
        tokens = tokenizer.encode(request.prompt)  # as LLM.generate tokenizes a text prompt
    else:
        tokens = list(request.prompt or [])
    # The prefix and one token more, so the prompt's snapshot is at the prefix's end.
    engine_prompt: dict[str, Any] = {"prompt_token_ids": prewarm_prompt(tokens)}
    if cache_salt is not None:
        engine_prompt["cache_salt"] = cache_salt
    params = SamplingParams(
        max_tokens=1, temperature=0.0, extra_args={PIN_TTL: request.ttl_s, REPORT: True}
    )
    (output,) = llm.generate([engine_prompt], params, use_tqdm=False)
    result = (output.kv_transfer_params or {}).get("vllm_hybrid") or {}
    pin = result.get("pin")
    if not pin:
        raise PinRefusedError(
            "prewarm: the engine took no pin (is prefix caching on and vllm-hybrid active?)"
        )
    if not pin.get("pinned"):
        raise PinRefusedError(f"prewarm: {pin.get('message')}")
    return {**pin, "prompt_tokens": len(tokens)}
