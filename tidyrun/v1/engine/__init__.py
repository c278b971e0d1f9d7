"""vLLM's ``vllm.v1.engine`` import path: ``llm_engine.LLMEngine``."""
