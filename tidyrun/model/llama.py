"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2 shapes) over a paged KV cache.

Q/K/V and gate/up projections are fused into one matrix each (fewer, larger
matmuls); ``load_weights`` maps the HF checkpoint names onto those shards and
refuses names or shapes it does not know.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..attention import ForwardContext, causal_attention_dense
from ..config import ModelConfig
from ..errors import ModelLoadError
from ..kv_cache import KVCache
from .layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from .ops import TorchOps


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ForwardContext, ops: TorchOps, dtype):
        super().__init__()
        self._ops = ops
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, cfg.attention_bias, ops, dtype)
        self.o_proj = Linear(cfg.q_size, cfg.hidden_size, False, ops, dtype)
        self._ctx = ctx

    def forward(self, x: torch.Tensor, rope, kv_cache: KVCache | None) -> torch.Tensor:
        tokens = x.shape[0]
        meta = self._ctx.metadata
        kv = None if meta.block_tables is None else kv_cache.layer(self.layer_idx)
        q, k, v = self._ops.rope_and_store(self.qkv_proj(x), rope, (self.num_heads, self.num_kv_heads, self.head_dim),
                                           kv, meta)
        if kv is None:  # KV-free (pooling): complete sequences, nothing cached
            out = causal_attention_dense(q, k, v, meta, self.scale)
        else:
            out = self._ops.attention(q, kv, meta, self.scale)
        return self.o_proj(out.reshape(tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, dtype):
        super().__init__()
        self._ops = ops
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, False, ops, dtype)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, False, ops, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._ops.silu_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ForwardContext, ops: TorchOps, dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, ctx, ops, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.mlp = LlamaMLP(cfg, ops, dtype)

    def forward(self, x, residual, rope, kv_cache):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_positions: int, ctx: ForwardContext, ops: TorchOps, dtype):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, ctx, ops, dtype) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.rotary = RotaryEmbedding(cfg, max_positions)


class LlamaForCausalLM(nn.Module):
    """The model in ``dtype``; KV cache and batch metadata come from the runner.

    Built on the meta device (no memory). Its device memory, the parameters
    and the RoPE table, is placed by the runner (WeightArena, RotaryEmbedding.build)
    and registered with the runner's ledger there. ``ops`` picks the torch
    reference or the Triton kernels for norms, activation, RoPE and attention.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, ctx: ForwardContext, dtype: torch.dtype,
                 ops: TorchOps | None = None):
        super().__init__()
        self.config = cfg
        self.ops = ops or TorchOps()
        self.model = LlamaModel(cfg, max_positions, ctx, self.ops, dtype)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, False, self.ops, dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache | None) -> torch.Tensor:
        """Final hidden states [T, hidden] for flat token ids [T] at ``positions``."""
        h = self.model.embed_tokens(input_ids)
        rope = self.ops.rope_tables(self.model.rotary, positions, h.dtype)
        residual = None
        for layer in self.model.layers:
            h, residual = layer(h, residual, rope, kv_cache)
        h, _ = self.model.norm(h, residual)
        return h

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model dtype: enough for an argmax, which float32 would not change."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.ops.linear(hidden, weight, None)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits, what sampling and scoring work on."""
        return self.logits(hidden).float()

    # -- weights -------------------------------------------------------------------------

    def weight_shards(self) -> dict[str, tuple[torch.Tensor, int, int, tuple[int, ...]]]:
        """HF name -> (parameter, first row, row count, parameter shape) for every weight the checkpoint must provide.

        Shapes come from the config, not the parameters, so weights can be
        checked while the parameters are released (asleep).
        """
        cfg = self.config
        h, q, kv, inter, vocab = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
        shards: dict[str, tuple[torch.Tensor, int, int, tuple[int, ...]]] = {}

        def whole(name: str, p: torch.Tensor, shape: tuple[int, ...]) -> None:
            shards[name] = (p, 0, shape[0], shape)

        whole("model.embed_tokens.weight", self.model.embed_tokens.weight, (vocab, h))
        whole("model.norm.weight", self.model.norm.weight, (h,))
        if self.lm_head is not None:
            whole("lm_head.weight", self.lm_head.weight, (vocab, h))
        for i, layer in enumerate(self.model.layers):
            pre = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            whole(pre + "input_layernorm.weight", layer.input_layernorm.weight, (h,))
            whole(pre + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight, (h,))
            whole(pre + "self_attn.o_proj.weight", attn.o_proj.weight, (h, q))
            whole(pre + "mlp.down_proj.weight", mlp.down_proj.weight, (h, inter))
            params = [("weight", attn.qkv_proj.weight, (q + 2 * kv, h))]
            if cfg.attention_bias:
                params.append(("bias", attn.qkv_proj.bias, (q + 2 * kv,)))
            for kind, p, shape in params:
                shards[pre + f"self_attn.q_proj.{kind}"] = (p, 0, q, shape)
                shards[pre + f"self_attn.k_proj.{kind}"] = (p, q, kv, shape)
                shards[pre + f"self_attn.v_proj.{kind}"] = (p, q + kv, kv, shape)
            gate_up = (2 * inter, h)
            shards[pre + "mlp.gate_proj.weight"] = (mlp.gate_up_proj.weight, 0, inter, gate_up)
            shards[pre + "mlp.up_proj.weight"] = (mlp.gate_up_proj.weight, inter, inter, gate_up)
        return shards

    def _target(self, shards: dict, name: str, tensor: torch.Tensor):
        """The (parameter, first row, rows) ``name`` goes to, after checking its shape and dtype."""
        if not isinstance(tensor, torch.Tensor):
            raise ModelLoadError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if name not in shards:
            raise ModelLoadError(f"unexpected weight {name!r}: no such parameter in this {self.config.architecture} model")
        param, start, rows, shape = shards[name]
        expected = (rows, *shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {expected}")
        if not tensor.is_floating_point():
            raise ModelLoadError(f"weight {name!r} has dtype {tensor.dtype}, expected a floating-point tensor")
        return param, start, rows

    def _check_complete(self, shards: dict, loaded: set[str]) -> None:
        missing = sorted(set(shards) - loaded)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")

    def check_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_all: bool = True) -> None:
        """Validate names, shapes and dtypes without copying anything (for all-or-nothing updates)."""
        shards = self.weight_shards()
        names = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            self._target(shards, name, tensor)
            names.add(name)
        if require_all:
            self._check_complete(shards, names)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_all: bool = True) -> set[str]:
        """Copy HF-named tensors into the (fused) parameters; returns the names loaded.

        Unknown names, shape mismatches and (with ``require_all``) missing names
        raise ModelLoadError naming the tensor. Parameters must be placed
        (materialized) first.
        """
        shards = self.weight_shards()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied head: some checkpoints store the copy anyway
            param, start, rows = self._target(shards, name, tensor)
            param.narrow(0, start, rows).copy_(tensor, non_blocking=False)
            loaded.add(name)
        if require_all:
            self._check_complete(shards, loaded)
        return loaded
