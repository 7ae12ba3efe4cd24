"""``logs.share_vllm_logging``: our logger prints through vLLM's handlers, once per line."""

from __future__ import annotations

import logging

from vllm_hybrid.adapters.vllm.logs import share_vllm_logging


def test_shares_vllm_handlers_except_those_records_reach_by_propagation() -> None:
    ours, theirs, root = (logging.getLogger(n) for n in ("vllm_hybrid", "vllm", ""))
    saved = (list(ours.handlers), ours.level, list(theirs.handlers), list(root.handlers))
    vllm_only, on_root_too = logging.NullHandler(), logging.NullHandler()
    try:
        ours.handlers.clear()
        ours.setLevel(logging.NOTSET)
        theirs.handlers[:] = [vllm_only, on_root_too]
        root.addHandler(on_root_too)
        share_vllm_logging()
        assert ours.handlers == [vllm_only]
        assert ours.level == theirs.level
        share_vllm_logging()  # once configured, left alone
        assert ours.handlers == [vllm_only]
    finally:
        ours.handlers[:], theirs.handlers[:], root.handlers[:] = saved[0], saved[2], saved[3]
        ours.setLevel(saved[1])
