"""vLLM's ``vllm.v1`` import path, for the modules user code imports from it (``v1.metrics.reader``)."""
