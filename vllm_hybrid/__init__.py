"""vllm-hybrid: hybrid-aware prefix caching for vLLM.

Importing this package imports neither torch nor vLLM; the engine pieces live in
``vllm_hybrid.adapters.vllm`` and the kernels in ``vllm_hybrid.ops``.
"""

__version__ = "0.1.0"

#: The vLLM release the adapter and the CPU patches were written against.
VLLM_VERSION = "0.32.0"
