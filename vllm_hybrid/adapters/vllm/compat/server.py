"""What the serving layer reads of vLLM 0.32.0's OpenAI-compatible server state: attributes
vLLM puts on ``app.state`` (``vllm/entrypoints/launchers/api_server/app_state.py::
init_app_state``, ``vllm/entrypoints/generate/api_router.py``), none of them documented API.
Each reader returns a fallback where the attribute is missing (an app that is not vLLM's, or
another release), so a request is never refused for it."""

from __future__ import annotations

from typing import Any


def _state(app: Any) -> Any:
    return getattr(app, "state", None)


def server_vllm_config(app: Any) -> Any:
    """The server's ``VllmConfig`` (``app.state.vllm_config``), or None."""
    return getattr(_state(app), "vllm_config", None)


def server_args(app: Any) -> Any:
    """The server's parsed command line (``app.state.args``, an ``argparse.Namespace``), or
    None."""
    return getattr(_state(app), "args", None)


def anthropic_merge_inline_system(app: Any) -> bool:
    """Whether the server's ``/v1/messages`` handler merges inline system blocks into the first
    message when it converts a request (``AnthropicServingMessages._merge_inline_system``, set in
    its ``__init__`` from the chat template; the converter,
    ``AnthropicServingMessages.to_chat_completion_request``, takes it as
    ``merge_inline_system``). False where the handler is missing."""
    serving = getattr(_state(app), "anthropic_serving_messages", None)
    return bool(getattr(serving, "_merge_inline_system", False))
