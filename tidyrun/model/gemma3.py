"""Gemma 3 (text): Llama's skeleton with Gemma's numerics, each difference a small override of llama.py.

- Embeddings are multiplied by sqrt(hidden) (rounded to the weights' dtype, as transformers does).
- RMSNorm is ``x * rsqrt(mean(x^2) + eps) * (1 + w)`` in float32, cast afterwards (``GemmaRMSNorm``).
- Four norms per layer: the attention's and the MLP's outputs are normed before they join the residual.
- The MLP is GeGLU (GELU, tanh approximation) instead of SwiGLU.
- Queries and keys get a per-head Gemma norm before RoPE; scores are scaled by
  ``query_pre_attn_scalar ** -0.5``.
- Layers alternate sliding-window and global attention (``ModelConfig.sliding_windows``); the windowed
  layers rotate with their own RoPE table (``rope_local_theta``, no scaling), the global ones with the
  config's base and scaling. The paged kernels take each layer's window; every layer keeps its whole
  KV cache (a block's keys serve the global layers too).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..attention import ForwardContext
from ..config import ModelConfig
from .layers import RMSNorm, RotaryEmbedding
from .llama import LayerState, LlamaAttention, LlamaForCausalLM, LlamaMLP, LlamaModel, WeightShard
from .ops import TorchOps
from .sharding import TPShard


class GemmaRMSNorm(RMSNorm):
    """Gemma's norm: the (1 + w) weight multiplies in float32 before the cast (transformers' Gemma3RMSNorm).
    Plain torch on every device (the fused kernel implements Llama's order)."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight.float())
        return h.to(x.dtype), x


class GemmaMLP(LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        out = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return out if self._tp is None else self._tp.all_reduce(out)


class GemmaAttention(LlamaAttention):
    norm_class = GemmaRMSNorm  # the config always asks for q/k norms (loader.hf sets qk_norm)

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ForwardContext, ops: TorchOps, dtype,
                 shard: TPShard, tp=None):
        super().__init__(cfg, layer_idx, ctx, ops, dtype, shard, tp)
        self.scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5

    def forward(self, x: torch.Tensor, rope, kv_cache) -> torch.Tensor:
        """``rope``: the step's (global, local) tables; a windowed layer rotates with the local one."""
        return super().forward(x, rope[1] if self.window else rope[0], kv_cache)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ForwardContext, ops: TorchOps, dtype,
                 shard: TPShard, tp=None):
        super().__init__()
        norm = lambda: GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)  # noqa: E731
        self.input_layernorm, self.post_attention_layernorm = norm(), norm()
        self.pre_feedforward_layernorm, self.post_feedforward_layernorm = norm(), norm()
        self.self_attn = GemmaAttention(cfg, layer_idx, ctx, ops, dtype, shard, tp)
        self.mlp = GemmaMLP(cfg, ops, dtype, shard, tp)

    def forward(self, x, residual, rope, kv_cache):
        """(this layer's output, the residual stream before it): the next layer's input norm adds them."""
        h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache))[0]
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h))[0], residual


class GemmaModel(LlamaModel):
    layer_class, norm_class = GemmaDecoderLayer, GemmaRMSNorm

    def __init__(self, cfg: ModelConfig, max_positions: int, ctx: ForwardContext, ops: TorchOps, dtype,
                 shard: TPShard, tp=None):
        super().__init__(cfg, max_positions, ctx, ops, dtype, shard, tp)
        self.rotary_local = RotaryEmbedding(cfg, max_positions, theta=cfg.rope_local_theta, scaling=None)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's text model (see the module docstring); weights, sleep and sharding as LlamaForCausalLM."""

    model_class = GemmaModel

    def rotary_tables(self) -> list[RotaryEmbedding]:
        return [self.model.rotary, self.model.rotary_local]

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> LayerState:
        h = self.model.embed_tokens(input_ids)
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        tables = tuple(self.ops.rope_tables(r, positions, h.dtype) for r in self.rotary_tables())
        return LayerState(h, None, tables)

    def weight_shards(self) -> dict[str, tuple[WeightShard, ...]]:
        shards = super().weight_shards()
        h = self.config.hidden_size
        for i, layer in enumerate(self.model.layers):
            pre = f"model.layers.{i}."
            shards[pre + "pre_feedforward_layernorm.weight"] = (WeightShard(layer.pre_feedforward_layernorm.weight, 0, (h,)),)
            shards[pre + "post_feedforward_layernorm.weight"] = (
                WeightShard(layer.post_feedforward_layernorm.weight, 0, (h,)),)
        return shards
