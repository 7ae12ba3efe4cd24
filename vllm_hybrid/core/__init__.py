"""The core: prefix index, policies, cost model, simulator-side state (no torch, no vLLM)."""
