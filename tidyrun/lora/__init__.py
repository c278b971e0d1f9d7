"""vLLM's ``vllm.lora`` import path. tidyrun has no LoRA adapters (``lora_request`` must be None)."""
