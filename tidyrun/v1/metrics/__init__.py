"""vLLM's ``vllm.v1.metrics`` import path."""
