"""Our log lines printed the way vLLM prints its own."""

from __future__ import annotations

import logging


def share_vllm_logging() -> None:
    """The ``vllm_hybrid`` logger gets the handlers and level vLLM configured on its ``vllm``
    logger (``vllm/logger.py``), unless the application configured ours itself. Records still
    propagate (to pytest's capture, say), so handlers the root logger has are not shared. vLLM
    configures logging when it builds the engine's config, after plugins load, so this runs
    when the scheduler starts (``scheduler.py::activate``) and when a host-tier worker
    registers its caches."""
    ours, theirs = logging.getLogger("vllm_hybrid"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    # a handler the root logger also has already gets our records by propagation: sharing it
    # too would print every line twice (and keep pytest's per-test capture handlers forever)
    reached = set(logging.getLogger().handlers) if ours.propagate else set()
    for handler in theirs.handlers:
        if handler not in reached:
            ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)
