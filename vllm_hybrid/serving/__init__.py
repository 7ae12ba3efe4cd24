"""The serving layer: what an HTTP server adds on top of the engine (vLLM 0.32.0's
OpenAI-compatible server).

- ``middleware.py``: :class:`HybridServingMiddleware`, the ASGI middleware (``cache_control``
  marks on chat and Anthropic messages, cache options validated, the prewarm and modules
  endpoints); ``vllm-hybrid serve`` adds it (``--middleware
  vllm_hybrid.serving.HybridServingMiddleware``).
- ``messages.py``: ``cache_control`` marks in OpenAI and Anthropic message formats.
- ``prewarm.py``, ``modules.py``: ``POST /v1/hybrid/prewarm`` and ``/v1/hybrid/modules``.
- ``asgi.py``: body replay, JSON answers, in-process calls to vLLM's routes.

Dependencies point one way: serving -> adapters/vllm (``compat.server`` only) and core; core
never imports serving (``tests/core/test_layering.py``), and the adapter does not either (the
middleware is registered by the command line, ``cli.py``, not by the plugin).
"""

from __future__ import annotations

from vllm_hybrid.serving.middleware import HybridServingMiddleware

__all__ = ["HybridServingMiddleware"]
