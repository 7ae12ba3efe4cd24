"""The Ray Serve app: N engine replicas (vLLM ``AsyncLLM`` + our plugin, each running vLLM's
own OpenAI server app in process) behind one ingress that tokenizes each request for routing,
sends it to the replica :class:`~vllm_hybrid.cluster.serve_router.HybridRequestRouter` picks
and streams the replica's answer back unchanged.

``build_app(model, vllm_args, replicas=N, router="state")`` is the documented app builder
(``vllm-hybrid serve MODEL --replicas N`` runs it with ``serve.run``). Endpoints: everything
vLLM's server has (``/v1/chat/completions``, ``/v1/completions``, streaming, ``cache_salt``,
our ``cache_control`` middleware, ``/v1/hybrid/prewarm`` ...) is served by the chosen replica;
the ingress adds ``GET /metrics`` (every replica's metrics, each line labelled
``replica="..."``, as of its last routing stats), ``GET /v1/hybrid/cluster`` (the router's
state and decisions) and the header ``x-vllm-hybrid-replica`` on every answer.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

from vllm_hybrid.cluster import ray_api
from vllm_hybrid.cluster.routing import RouteRequest, live_router
from vllm_hybrid.sim.routers import check_routers

LOG = logging.getLogger("vllm_hybrid.cluster")
ENGINE_NAME, INGRESS_NAME = "HybridEngine", "HybridIngress"
REPLICA_HEADER = "x-vllm-hybrid-replica"
MIDDLEWARE = "vllm_hybrid.serving.HybridServingMiddleware"
#: Environment variables handed to every replica (engine settings, hash seeds, our own).
ENV_PREFIXES = ("VLLM_", "PYTHONHASHSEED", "HF_", "OMP_", "TOKENIZERS_")
#: vLLM flags that belong to the ingress, not to the replicas' in-process servers.
INGRESS_FLAGS = ("--host", "--port")
#: How often a replica renders its ``/metrics`` for the ingress (the digest goes every period).
METRICS_PERIOD_S = 2.0


class ClusterUsageError(ValueError):
    """Bad cluster options (the message names the fix)."""


def split_ingress_flags(vllm_args: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """(``{"--host": ..., "--port": ...}``, the other flags)."""
    found: dict[str, str] = {}
    rest: list[str] = []
    args = list(vllm_args)
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, value = arg.partition("=")
        if name in INGRESS_FLAGS:
            if eq:
                found[name] = value
            elif i + 1 < len(args):
                found[name] = args[i + 1]
                i += 1
        else:
            rest.append(arg)
        i += 1
    return found, rest


def check_cluster_options(replicas: int, router: str) -> None:
    if replicas < 1:
        raise ClusterUsageError(
            f"--replicas must be >= 1, got {replicas} (without --replicas, serve runs one "
            "engine with no Ray)"
        )
    try:
        check_routers([router])
    except ValueError as error:
        raise ClusterUsageError(f"--router: {error}") from None


def replica_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    # AsyncLLM runs its engine core in a child process (the digest is a utility call there);
    # a test process's in-process setting must not reach the replicas.
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
    return env


def session_of(path: str, body: dict[str, Any]) -> str | None:
    """The conversation a request belongs to: the OpenAI ``user`` field if set, else (chat)
    the cache salt, system prompt and first user message, which every turn of a chat repeats."""
    user = body.get("user")
    if isinstance(user, str) and user:
        return f"user:{user}"
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    head = []
    for message in messages:
        head.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    blob = json.dumps([body.get("cache_salt"), head], sort_keys=True, default=str)
    return "chat:" + hashlib.blake2b(blob.encode(), digest_size=8).hexdigest()


class PromptTokens:
    """The ingress's tokenizer: a request's prompt token ids as the replica will see them (for
    routing only: a mismatch costs a shorter predicted hit, never a wrong answer)."""

    def __init__(self, model: str, trust_remote_code: bool = False) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)

    def _render(self, body: dict[str, Any], messages: list[Any], generation: bool) -> list[int]:
        ids = self.tok.apply_chat_template(
            messages,
            add_generation_prompt=generation,
            tokenize=True,
            **(body.get("chat_template_kwargs") or {}),
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def system_breakpoint(self, body: dict[str, Any], ids: Sequence[int]) -> int | None:
        """Where the replica's middleware puts a chat's system-prompt breakpoint (its state is
        kept there: docs/serving.md), rendered the same way
        (``serving/middleware.py::_system_breakpoint``), or None."""
        from vllm_hybrid.core import common_prefix_tokens
        from vllm_hybrid.serving.messages import CACHE_CONTROL, system_prompt_probe

        messages = body.get("messages")
        if not isinstance(messages, list) or CACHE_CONTROL in json.dumps(messages, default=str):
            return None  # marked requests keep their own breakpoints
        probe = system_prompt_probe(messages)
        if probe is None or not ids:
            return None
        try:
            head = self._render(body, probe, False)
        except Exception:  # the template refuses the probe: the middleware adds none either
            return None
        position = common_prefix_tokens(head, ids)
        return position if position > 0 else None

    def __call__(self, path: str, body: dict[str, Any]) -> list[int]:
        from vllm_hybrid.serving.messages import strip_cache_control

        try:
            if path.endswith("/chat/completions") and isinstance(body.get("messages"), list):
                messages = strip_cache_control(body["messages"])
                return self._render(body, messages, body.get("add_generation_prompt", True))
            prompt = body.get("prompt")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return [int(t) for t in prompt]
            if isinstance(prompt, list) and len(prompt) == 1:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return list(self.tok(prompt, add_special_tokens=True)["input_ids"])
        except Exception as error:  # routing must never fail a request
            LOG.debug("could not tokenize for routing: %s", error)
        return []


def _relabel(metrics: str, replica: str) -> list[str]:
    out = []
    for line in metrics.splitlines():
        if not line or line.startswith("#"):
            continue
        name, brace, rest = line.partition("{")
        if brace:
            out.append(f'{name}{{replica="{replica}",{rest}')
        else:
            metric, _, value = line.partition(" ")
            out.append(f'{metric}{{replica="{replica}"}} {value}')
    return out


def build_app(
    model: str,
    vllm_args: Sequence[str] = (),
    *,
    replicas: int = 2,
    router: str = "state",
    throughput_tflops: float = 0.05,
    overload_wait_s: float = 2.0,
    stats_period_s: float = 0.25,
    replica_cpus: float = 0.0,
    replica_gpus: float = 0.0,
    max_ongoing_requests: int = 64,
    served_name: str | None = None,
) -> Any:
    """The Serve app (module docstring). ``throughput_tflops``: the prefill FLOP/s one replica
    sustains, the router's time unit (0.05 TFLOP/s: a tiny model on a few CPU cores; say
    ~400 on an H100-class GPU); ``stats_period_s``: how often each replica pushes its digest;
    ``replica_gpus``: GPUs Ray reserves per replica (tensor x pipeline parallel size: vLLM's
    workers of one replica run inside the GPUs Ray gives that replica's actor)."""
    check_cluster_options(replicas, router)
    ray_api.require_ray()
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse

    _, engine_args = split_ingress_flags(vllm_args)
    shape_path = os.path.join(os.path.expanduser(model), "config.json")
    if not os.path.isfile(shape_path):
        shape_path = model  # a shipped shape name or HF model type (load_shape resolves it)
    env = {"env_vars": replica_env()}
    router_kwargs = {
        "policy": router,
        "shape_path": shape_path,
        "throughput_tflops": throughput_tflops,
        "overload_wait_s": overload_wait_s,
    }

    @serve.deployment(
        name=ENGINE_NAME,
        num_replicas=replicas,
        max_ongoing_requests=max_ongoing_requests,
        ray_actor_options={"num_cpus": replica_cpus, "num_gpus": replica_gpus, "runtime_env": env},
        request_router_config=ray_api.router_config(
            "vllm_hybrid.cluster.serve_router.HybridRequestRouter", router_kwargs, stats_period_s
        ),
        health_check_period_s=2,
        health_check_timeout_s=30,
    )
    class HybridEngine:
        """One replica: an ``AsyncLLM`` with our plugin and vLLM's OpenAI app around it."""

        async def __init__(self) -> None:
            from vllm_hybrid.adapters.vllm.compat.cluster import start_engine_app

            middleware = [] if os.environ.get("VLLM_HYBRID_ENABLE", "1") == "0" else [
                "--middleware", MIDDLEWARE,
            ]  # fmt: skip
            self.key = ray_api.current_replica_key()
            self.engine, self.app = await start_engine_app(model, [*middleware, *engine_args])
            self.digest_s: list[float] = []
            self.metrics, self.metrics_at = "", 0.0

        async def record_routing_stats(self) -> dict[str, Any]:
            """Ray calls it every ``stats_period_s`` and hands the result to the routers."""
            from vllm_hybrid.adapters.vllm.compat.cluster import route_digest

            start = time.perf_counter()
            digest = await route_digest(self.engine)
            self.digest_s = [*self.digest_s[-999:], time.perf_counter() - start]
            if time.monotonic() - self.metrics_at >= METRICS_PERIOD_S:
                status, _, metrics = await self._call("GET", "/metrics", b"")
                self.metrics = metrics.decode() if status == 200 else ""
                self.metrics_at = time.monotonic()
            return {
                "digest": digest,
                "replica": self.key,
                "metrics": self.metrics,
                "digest_ms_p50": 1e3 * sorted(self.digest_s)[len(self.digest_s) // 2],
            }

        async def _call(self, method: str, path: str, body: bytes) -> tuple[int, Any, bytes]:
            chunks: list[bytes] = []
            status, headers = 500, []
            async for item in self.http(None, method, path, "", [], body):
                if isinstance(item, tuple):
                    status, headers = item
                else:
                    chunks.append(item)
            return status, headers, b"".join(chunks)

        async def http(
            self,
            route: RouteRequest | None,
            method: str,
            path: str,
            query: str,
            headers: list[tuple[str, str]],
            body: bytes,
        ) -> AsyncIterator[Any]:
            """One HTTP request through vLLM's app in process: yields (status, headers) once,
            then the body's chunks as the app sends them (streaming included)."""
            queue: asyncio.Queue[Any] = asyncio.Queue()
            sent = False

            async def receive() -> dict[str, Any]:
                nonlocal sent
                if not sent:
                    sent = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await asyncio.Event().wait()  # the client stays connected
                return {"type": "http.disconnect"}

            async def send(message: dict[str, Any]) -> None:
                await queue.put(message)

            scope = {
                "type": "http",
                "asgi": {"version": "3.0"},
                "http_version": "1.1",
                "method": method,
                "scheme": "http",
                "path": path,
                "raw_path": path.encode(),
                "query_string": query.encode(),
                "root_path": "",
                "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
                "client": ("127.0.0.1", 0),
                "server": ("127.0.0.1", 0),
                "app": self.app,
            }
            task = asyncio.create_task(self.app(scope, receive, send))
            try:
                while True:
                    getter = asyncio.ensure_future(queue.get())
                    done, _ = await asyncio.wait({getter, task}, return_when="FIRST_COMPLETED")
                    if getter not in done:  # the app returned without another message
                        getter.cancel()
                        error = None if task.cancelled() else task.exception()
                        if error is not None:
                            raise error
                        return
                    message = getter.result()
                    if message["type"] == "http.response.start":
                        out = [(k.decode(), v.decode()) for k, v in message.get("headers", [])]
                        out = [(k, v) for k, v in out if k.lower() != "content-length"]
                        yield message["status"], [*out, (REPLICA_HEADER, self.key)]
                    elif message["type"] == "http.response.body":
                        if message.get("body"):
                            yield bytes(message["body"])
                        if not message.get("more_body", False):
                            return
            finally:
                if not task.done():
                    task.cancel()

    @serve.deployment(
        name=INGRESS_NAME,
        num_replicas=1,
        max_ongoing_requests=1024,
        ray_actor_options={"num_cpus": 0, "runtime_env": env},
    )
    class HybridIngress:
        """The OpenAI-compatible front door (module docstring)."""

        def __init__(self, engine: Any) -> None:
            self.engine = engine
            self.tokens = PromptTokens(model, "--trust-remote-code" in engine_args)
            self.app_name = serve.get_replica_context().app_name

        def _router(self) -> Any:
            return live_router(self.app_name)

        async def __call__(self, request: Request) -> Any:
            path = request.url.path
            if request.method == "GET" and path == "/v1/hybrid/cluster":
                state = self._router().state() if self._router() else {"policy": router}
                return JSONResponse(state)
            if request.method == "GET" and path == "/metrics":
                return PlainTextResponse(self._metrics())
            body = await request.body()
            route = RouteRequest(uuid.uuid4().hex)
            if request.method == "POST" and body:
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = None
                if isinstance(parsed, dict):
                    ids = self.tokens(path, parsed)
                    salt = parsed.get("cache_salt")
                    breakpoint = self.tokens.system_breakpoint(parsed, ids)
                    route = RouteRequest(
                        route.request_id,
                        tuple(ids),
                        salt if isinstance(salt, str) else None,
                        session_of(path, parsed),
                        () if breakpoint is None else (breakpoint,),
                    )
            headers = [(k, v) for k, v in request.headers.items() if k.lower() != "host"]
            return await self._forward(
                route, request.method, path, request.url.query, headers, body
            )

        async def _forward(
            self,
            route: RouteRequest,
            method: str,
            path: str,
            query: str,
            headers: list[tuple[str, str]],
            body: bytes,
        ) -> Any:
            died = ray_api.actor_died_errors()
            for attempt in (1, 2):  # a replica that dies before answering: retried once
                stream = self.engine.options(stream=True).http.remote(
                    route, method, path, query, headers, body
                )
                try:
                    status, out_headers = await stream.__anext__()
                except died as error:
                    LOG.warning(
                        "request %s: replica died (%s), attempt %d",
                        route.request_id,
                        error,
                        attempt,
                    )
                    if attempt == 2:
                        return JSONResponse(
                            {
                                "error": {
                                    "message": "the replica serving this request died and "
                                    "the retry failed too; retry later",
                                    "type": "ReplicaDied",
                                    "code": 503,
                                }
                            },
                            status_code=503,
                        )
                    continue
                break

            async def chunks() -> AsyncIterator[bytes]:
                try:
                    async for chunk in stream:
                        yield chunk
                except died:
                    message = {
                        "error": {
                            "message": "the replica serving this request died mid-answer; "
                            "retry the request",
                            "type": "ReplicaDied",
                            "code": 503,
                        }
                    }
                    yield f"data: {json.dumps(message)}\n\n".encode()

            media = dict((k.lower(), v) for k, v in out_headers).get("content-type")
            keep = {k: v for k, v in out_headers if k.lower() != "content-type"}
            return StreamingResponse(chunks(), status_code=status, headers=keep, media_type=media)

        def _metrics(self) -> str:
            router_state = self._router()
            lines = [
                "# vllm-hybrid cluster: each replica's /metrics as of its last routing stats",
            ]
            if router_state is None:
                return "\n".join(lines) + "\n"
            stats = getattr(router_state, "last_stats", {})
            for replica, text in sorted(stats.items()):
                lines += _relabel(text, replica)
            return "\n".join(lines) + "\n"

    return HybridIngress.bind(HybridEngine.bind())  # type: ignore[attr-defined]
