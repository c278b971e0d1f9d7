"""vLLM's ``vllm.transformers_utils`` import path (``.tokenizer.get_tokenizer``)."""
