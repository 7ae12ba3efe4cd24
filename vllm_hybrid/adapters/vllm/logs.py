"""Our log lines printed the way vLLM prints its own."""

from __future__ import annotations

import logging


def share_vllm_logging() -> None:
    """The ``vllm_hybrid`` logger gets the handlers and level vLLM configured on its ``vllm``
    logger (``vllm/logger.py``), unless the application configured ours itself. Records still
    propagate (to pytest's capture, say). vLLM configures logging when it builds the engine's
    config, after plugins load, so this runs when the scheduler starts
    (``scheduler.py::activate``) and when a host-tier worker registers its caches."""
    ours, theirs = logging.getLogger("vllm_hybrid"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)
