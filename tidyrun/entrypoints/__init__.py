"""vLLM's ``vllm.entrypoints`` import path (``.chat_utils``); tidyrun's server is ``tidyrun.server``."""
