"""The vLLM version this adapter was written against, and the check every patch runs."""

from __future__ import annotations

import logging

from vllm_hybrid import VLLM_VERSION

logger = logging.getLogger("vllm_hybrid")


class UnsupportedVLLMVersion(RuntimeError):
    """The installed vLLM is not the release the adapter's hooks were written for."""


def installed_vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def check_vllm_version(what: str) -> bool:
    """True when the installed vLLM is the pinned release; otherwise log why ``what`` is off.

    Patches and subclasses reach into vLLM internals that change between releases, so they
    refuse to run on any other version rather than misbehave silently.
    """
    found = installed_vllm_version()
    if found.split("+")[0] == VLLM_VERSION:
        return True
    logger.warning(
        "vllm-hybrid: %s is disabled: it was written for vLLM %s but vLLM %s is installed. "
        "Install vllm-hybrid's pinned extra (pip install 'vllm-hybrid[cpu]' or "
        "'vllm-hybrid[cuda]').",
        what,
        VLLM_VERSION,
        found,
    )
    return False
