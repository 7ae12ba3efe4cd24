"""One row over HTTP: replay against a running OpenAI-compatible server (``vllm-hybrid serve``).

Each request is a streamed ``/v1/completions`` call whose prompt is the token-id list, sent at
its scaled arrival time (asyncio, one task per request). Measured per request: TTFT = arrival
to the first streamed chunk that carries output; latency = arrival to the end of the stream;
cached tokens = ``usage.prompt_tokens_details.cached_tokens`` of the final usage chunk (the
server must run with ``--enable-prompt-tokens-details``, else they read as 0 and a warning is
printed). Output token ids come from vLLM's ``return_token_ids`` extension.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from typing import Any

from vllm_hybrid.bench import BenchError
from vllm_hybrid.bench.report import RequestRecord, RowResult
from vllm_hybrid.bench.workload import TOKEN_HI, TOKEN_LO, BenchRequest, time_scale_for_rate


def _client(url: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", timeout=3600)


async def _model_name(client: Any, served_model: str | None) -> str:
    if served_model:
        return served_model
    models = await client.models.list()
    if not models.data:
        raise BenchError("the server lists no model; pass --served-model")
    return str(models.data[0].id)


async def _stream(client: Any, model: str, ids: list[int], max_tokens: int) -> dict[str, Any]:
    """One streamed completion; times are ``time.perf_counter()`` values."""
    stream = await client.completions.create(
        model=model,
        prompt=ids,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    first, out_ids, usage = None, [], None
    async for chunk in stream:
        if chunk.choices:
            choice = chunk.choices[0]
            delta = list(getattr(choice, "token_ids", None) or [])
            if first is None and (delta or choice.text):
                first = time.perf_counter()
            out_ids += delta
        if chunk.usage is not None:
            usage = chunk.usage
    end = time.perf_counter()
    return {"first": first or end, "end": end, "ids": out_ids, "usage": usage}


def _cached_tokens(usage: Any) -> int | None:
    details = getattr(usage, "prompt_tokens_details", None) if usage is not None else None
    cached = getattr(details, "cached_tokens", None) if details is not None else None
    return None if cached is None else int(cached)


async def _pace(client: Any, model: str, reqs: list[BenchRequest], n: int) -> float:
    """Seconds one uncached request of the workload's median size takes (last of ``n``)."""
    prompt_len = sorted(r.prompt_tokens for r in reqs)[len(reqs) // 2]
    out_len = sorted(r.max_tokens for r in reqs)[len(reqs) // 2]
    rng, seconds = random.Random(0xBE7C4 ^ int(time.time())), 0.0
    for _ in range(max(1, n)):
        ids = [rng.randrange(TOKEN_LO, TOKEN_HI) for _ in range(prompt_len)]
        start = time.perf_counter()
        await _stream(client, model, ids, out_len)
        seconds = time.perf_counter() - start
    return seconds


async def _replay(
    args: argparse.Namespace,
    reqs: list[BenchRequest],
    time_scale: float | None,
    bar: Any,
) -> RowResult:
    client = _client(args.url)
    model = await _model_name(client, args.served_model)
    if time_scale is None:
        pace_s = await _pace(client, model, reqs, args.warmup)
        rate = args.load / max(pace_s, 1e-6)
        time_scale = time_scale_for_rate(reqs, rate, args.load_window)
    bar.reset()  # time the replay, not the warm-up
    t0 = time.perf_counter()

    async def one(req: BenchRequest) -> tuple[BenchRequest, dict[str, Any]]:
        await asyncio.sleep(max(0.0, req.arrival_s * time_scale - (time.perf_counter() - t0)))
        got = await _stream(client, model, list(req.prompt_token_ids), req.max_tokens)
        bar.update(1)
        return req, got

    results = await asyncio.gather(*(one(r) for r in reqs))
    wall = max(got["end"] for _, got in results) - t0
    records = [_record(req, got, req.arrival_s * time_scale, t0) for req, got in results]
    if any(_cached_tokens(got["usage"]) is None for _, got in results):
        print(
            "warning: the server does not report cached tokens (start it with "
            "--enable-prompt-tokens-details); they read as 0",
            file=sys.stderr,
        )
    return RowResult(args.label, None, wall, time_scale, records)


def _record(req: BenchRequest, got: dict[str, Any], arrival: float, t0: float) -> RequestRecord:
    return RequestRecord(
        index=req.index,
        arrival_s=arrival,
        prompt_tokens=req.prompt_tokens,
        cached_tokens=_cached_tokens(got["usage"]) or 0,
        output_tokens=int(getattr(got["usage"], "completion_tokens", 0) or len(got["ids"])),
        ttft_s=got["first"] - t0 - arrival,
        latency_s=got["end"] - t0 - arrival,
        output_token_ids=got["ids"],
    )


def replay_http(
    args: argparse.Namespace,
    reqs: list[BenchRequest],
    time_scale: float | None,
    bar: Any,
) -> RowResult:
    """Replay ``reqs`` against ``args.url``; ``time_scale`` None means --rate auto; ``bar``
    is a tqdm progress bar (one update per finished request)."""
    import openai

    try:
        return asyncio.run(_replay(args, reqs, time_scale, bar))
    except openai.APIConnectionError:
        raise BenchError(f"cannot reach a server at {args.url}") from None
    except openai.APIStatusError as exc:
        raise BenchError(f"server at {args.url} refused a request: {exc.message}") from None
