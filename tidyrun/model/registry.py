"""Which model class runs which architecture (every class shares LlamaForCausalLM's interface)."""

from __future__ import annotations

from types import MappingProxyType

import torch

from ..attention import ForwardContext
from ..config import ModelConfig
from .gemma3 import Gemma3ForCausalLM
from .llama import LlamaForCausalLM
from .moe import MoEForCausalLM
from .ops import TorchOps
from .sharding import TPShard

_CLASSES = MappingProxyType({"gemma3": Gemma3ForCausalLM, "mixtral": MoEForCausalLM, "qwen3_moe": MoEForCausalLM,
                             "olmoe": MoEForCausalLM})


def model_class(cfg: ModelConfig) -> type[LlamaForCausalLM]:
    """The class of ``cfg.architecture``: its own where it has one, else the Llama family's."""
    return _CLASSES.get(cfg.architecture, LlamaForCausalLM)


def skeleton(cfg: ModelConfig, shard: TPShard | None = None, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The model of ``cfg`` (this rank's slice) on the meta device: its parameters' shapes, no memory."""
    return model_class(cfg)(cfg, 1, ForwardContext(), dtype, TorchOps(), shard)


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every weight a checkpoint of ``cfg`` holds (from the model's own weight map)."""
    return {name: pieces[0].shape for name, pieces in skeleton(cfg).weight_shards().items()}
