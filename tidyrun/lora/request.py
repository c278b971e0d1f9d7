"""``LoRARequest``, importable where vLLM's code imports it from, so that a script which builds one only when an
adapter is configured (lm-eval, TRL) runs unchanged without one. ``generate(lora_request=LoRARequest(...))``
is refused with an InvalidRequestError: tidyrun serves merged weights only (``load_weights``)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class LoRARequest:
    """vLLM's fields: the adapter's name, its int id (>= 1) and where its files are."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None


__all__ = ("LoRARequest",)
