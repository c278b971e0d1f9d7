"""Which model class runs which architecture (every class shares LlamaForCausalLM's interface)."""

from __future__ import annotations

from types import MappingProxyType

from ..config import ModelConfig
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM

_CLASSES = MappingProxyType({"gemma3": Gemma3ForCausalLM})


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The class of ``cfg.architecture``: its own where it has one, else the Llama family's."""
    return _CLASSES.get(cfg.architecture, LlamaForCausalLM)
