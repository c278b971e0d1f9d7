"""Llama-family decoder (Llama, SmolLM, Mistral, Qwen2, Qwen3, Phi-3 shapes) over a paged KV cache.

Qwen3 is Llama plus one step: an RMSNorm over each query and key head (its
own weight, [head_dim], shared by the heads) between the QKV projection and
RoPE (``ModelConfig.qk_norm``). Phi-3 is Llama whose checkpoint already
fuses qkv_proj and gate_up_proj (``ModelConfig.fused_checkpoint``), with
its longrope RoPE (``layers.rope_inv_freq``).

Q/K/V and gate/up projections are fused into one matrix each (fewer, larger
matmuls); ``load_weights`` maps the HF checkpoint names onto those shards and
refuses names or shapes it does not know.

With tensor parallelism (a ``TPShard`` of ``world > 1`` and its ``TPGroup``)
each rank builds only its slice: QKV column-parallel by KV head, o_proj and
down_proj row-parallel (followed by an all-reduce), gate/up column-parallel by
intermediate channel, embedding and LM head vocabulary-parallel (logits are
gathered on rank 0, or on every rank when each samples for itself).
Checkpoint tensors stay full-sized; each rank copies its slice of them (or
takes a tensor that already is its slice, as a launched rank may be given).
With ``world == 1`` no collective runs and every slice is the whole tensor.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from ..attention import ForwardContext, causal_attention_dense
from ..config import ModelConfig
from .sharding import TPShard, split_range
from ..errors import ModelLoadError
from ..kv_cache import KVCache
from .layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from .ops import TorchOps


@dataclass(frozen=True)
class WeightShard:
    """Where one piece of a checkpoint tensor (or of its tensor-parallel slice) goes.

    The checkpoint tensor has the full ``shape``; its slice ``[start, start +
    length)`` along ``dim`` is copied to rows ``[row, row + rows)`` of
    ``param``. Unsplit weights take the whole of dimension 0. A checkpoint
    tensor that is already fused (Phi-3's qkv_proj, gate_up_proj) goes in
    several pieces: under tensor parallelism a rank's q, k and v rows are
    three separate slices of it. ``expert``: the piece goes to that index of
    a stacked parameter ([experts, ...] of a mixture of experts).
    """

    param: torch.Tensor
    row: int
    shape: tuple[int, ...]
    dim: int = 0
    start: int = 0
    length: int | None = None  # None: the whole dimension
    expert: int | None = None

    def source(self, tensor: torch.Tensor) -> torch.Tensor:
        """The part of the (full) checkpoint tensor this rank keeps: a view, never a copy."""
        if self.length is None:
            return tensor
        return tensor.narrow(self.dim, self.start, self.length)

    @property
    def rows(self) -> int:
        return self.shape[0] if self.dim != 0 or self.length is None else self.length

    def within(self, shape: tuple[int, ...], offset: int) -> WeightShard:
        """The same piece read from a fused tensor of ``shape``, where its part starts ``offset`` rows in."""
        return WeightShard(self.param, self.row, shape, self.dim, self.start + offset, self.length, self.expert)

    def copy_(self, tensor: torch.Tensor) -> None:
        """Copy this rank's part of the checkpoint ``tensor`` into its rows of the (placed) parameter."""
        param = self.param if self.expert is None else self.param[self.expert]
        param.narrow(0, self.row, self.rows).copy_(self.source(tensor))


def rank_slice(pieces: tuple[WeightShard, ...]) -> tuple[WeightShard, ...] | None:
    """The same pieces read from a tensor that holds only this rank's slice of the checkpoint tensor (its
    pieces back to back along the split dimension), or None when the tensor is not split."""
    dim = pieces[0].dim
    if any(p.length is None or p.dim != dim for p in pieces):
        return None
    shape = list(pieces[0].shape)
    shape[dim] = sum(p.length for p in pieces)
    if tuple(shape) == pieces[0].shape:
        return None
    out, offset = [], 0
    for p in pieces:
        out.append(WeightShard(p.param, p.row, tuple(shape), dim, offset, p.length, p.expert))
        offset += p.length
    return tuple(out)


class LlamaAttention(nn.Module):
    norm_class = RMSNorm  # of the per-head q/k norms (Qwen3); a variant's subclass names its own

    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ForwardContext, ops: TorchOps, dtype,
                 shard: TPShard, tp=None):
        super().__init__()
        self._ops = ops
        self._tp = tp
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = shard.num_heads, shard.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = shard.num_heads * cfg.head_dim, shard.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim ** -0.5
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.attention_bias, ops, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, False, ops, dtype)
        # Per head (Qwen3, Gemma 3), or over this rank's whole q / k projection (OLMoE).
        q_dim, k_dim = (self.q_size, self.kv_size) if cfg.qk_norm_whole else (cfg.head_dim, cfg.head_dim)
        self.q_norm = self.norm_class(q_dim, cfg.rms_norm_eps, ops, dtype) if cfg.qk_norm else None
        self.k_norm = self.norm_class(k_dim, cfg.rms_norm_eps, ops, dtype) if cfg.qk_norm else None
        self._norm_whole = cfg.qk_norm_whole
        self._full_sizes = (cfg.q_size, cfg.kv_size)  # the whole model's, over which OLMoE's norms average
        # A sliding-window layer's width (Mistral, Qwen2's upper layers, Gemma 3's local ones); None: global.
        self.window: int | None = (cfg.sliding_windows[layer_idx] or None) if cfg.sliding_windows else None
        self._ctx = ctx

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """The RMSNorm of the queries and keys (values untouched), back in the fused layout."""
        q, k = qkv[:, :self.q_size], qkv[:, self.q_size:self.q_size + self.kv_size]
        if self._norm_whole:
            q, k = (self._whole_norm(x, norm, full) for x, norm, full in
                    zip((q, k), (self.q_norm, self.k_norm), self._full_sizes))
        else:
            tokens, d = qkv.shape[0], self.head_dim
            q = self.q_norm(q.reshape(-1, d))[0].view(tokens, self.q_size)
            k = self.k_norm(k.reshape(-1, d))[0].view(tokens, self.kv_size)
        return torch.cat([q, k, qkv[:, self.q_size + self.kv_size:]], dim=-1)

    def _whole_norm(self, x: torch.Tensor, norm: RMSNorm, full: int) -> torch.Tensor:
        """OLMoE's norm over the whole projection; under tensor parallelism the ranks' squares are summed
        first, since each holds only some heads."""
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        if self._tp is not None:
            squares = self._tp.all_reduce(squares)
        return norm.weight * (h * torch.rsqrt(squares / full + norm.eps)).to(x.dtype)

    def forward(self, x: torch.Tensor, rope, kv_cache: KVCache | None) -> torch.Tensor:
        tokens = x.shape[0]
        meta = self._ctx.metadata
        kv = None if meta.block_tables is None else kv_cache.layer(self.layer_idx)
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        q, k, v = self._ops.rope_and_store(qkv, rope, (self.num_heads, self.num_kv_heads, self.head_dim), kv, meta)
        if kv is None:  # KV-free (pooling): complete sequences, nothing cached
            out = causal_attention_dense(q, k, v, meta, self.scale, self.window)
        else:
            out = self._ops.attention(q, kv, meta, self.scale, self.window)
        out = self.o_proj(out.reshape(tokens, self.q_size))
        return out if self._tp is None else self._tp.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: TorchOps, dtype, shard: TPShard, tp=None):
        super().__init__()
        self._ops = ops
        self._tp = tp
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * shard.intermediate_size, False, ops, dtype)
        self.down_proj = Linear(shard.intermediate_size, cfg.hidden_size, False, ops, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(self._ops.linear_silu_mul(x, self.gate_up_proj.weight))
        return out if self._tp is None else self._tp.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ctx: ForwardContext, ops: TorchOps, dtype,
                 shard: TPShard, tp=None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.self_attn = LlamaAttention(cfg, layer_idx, ctx, ops, dtype, shard, tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.mlp = self.build_mlp(cfg, layer_idx, ops, dtype, shard, tp)

    def build_mlp(self, cfg: ModelConfig, layer_idx: int, ops: TorchOps, dtype, shard: TPShard, tp) -> nn.Module:
        """This layer's feed-forward block (a mixture-of-experts variant picks per layer)."""
        return LlamaMLP(cfg, ops, dtype, shard, tp)

    def forward(self, x, residual, rope, kv_cache):
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, rope, kv_cache)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    layer_class, norm_class = LlamaDecoderLayer, RMSNorm  # a variant's subclass names its own

    def __init__(self, cfg: ModelConfig, max_positions: int, ctx: ForwardContext, ops: TorchOps, dtype,
                 shard: TPShard, tp=None):
        super().__init__()
        self.embed_tokens = Embedding(shard.vocab_size, cfg.hidden_size, dtype, shard.vocab[0], tp)
        self.layers = nn.ModuleList(self.layer_class(cfg, i, ctx, ops, dtype, shard, tp)
                                    for i in range(cfg.num_layers))
        self.norm = self.norm_class(cfg.hidden_size, cfg.rms_norm_eps, ops, dtype)
        self.rotary = RotaryEmbedding(cfg, max_positions)


class LayerState(NamedTuple):
    """What flows from one decoder layer to the next: hidden states, the residual (None before the
    first layer) and the RoPE tables of the step."""
    h: torch.Tensor
    residual: torch.Tensor | None
    rope: tuple


class LlamaForCausalLM(nn.Module):
    """The model in ``dtype``; KV cache and batch metadata come from the runner.

    Built on the meta device (no memory). Its device memory, the parameters
    and the RoPE table, is placed by the runner (WeightArena, RotaryEmbedding.build)
    and registered with the runner's ledger there. ``ops`` picks the torch
    reference or the Triton kernels for norms, activation, RoPE and attention.
    ``shard``/``tp``: this rank's slice and the group its collectives run
    over (tensor parallelism); the default is the whole model, no group.
    """

    model_class = LlamaModel  # the decoder stack (a variant's subclass names its own)

    def __init__(self, cfg: ModelConfig, max_positions: int, ctx: ForwardContext, dtype: torch.dtype,
                 ops: TorchOps | None = None, shard: TPShard | None = None, tp=None):
        super().__init__()
        self.config = cfg
        self.ops = ops or TorchOps()
        self.shard = shard or TPShard.of(cfg)
        self._tp = tp
        self._vocab_sizes = [split_range(cfg.vocab_size, self.shard.world, r)[1] for r in range(self.shard.world)]
        self.model = self.model_class(cfg, max_positions, ctx, self.ops, dtype, self.shard, tp)
        self.lm_head = (None if cfg.tie_word_embeddings
                        else Linear(cfg.hidden_size, self.shard.vocab_size, False, self.ops, dtype))
        # Told of every load (the runner's Weights component sets it): which weights are missing, and
        # whether their memory is placed at all.
        self.weight_status = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache | None) -> torch.Tensor:
        """Final hidden states [T, hidden] for flat token ids [T] at ``positions``."""
        state = self.run_layers(self.embed(input_ids, positions), kv_cache, 0, len(self.model.layers))
        return self.final_norm(state)

    def rotary_tables(self) -> list[RotaryEmbedding]:
        """The RoPE tables the runner builds on the device (and releases when the weights sleep)."""
        return [self.model.rotary]

    # The forward in three parts, so that a CUDA graph manager can capture it in pieces.

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> LayerState:
        h = self.model.embed_tokens(input_ids)
        return LayerState(h, None, self.ops.rope_tables(self.model.rotary, positions, h.dtype))

    def run_layers(self, state: LayerState, kv_cache: KVCache | None, start: int, end: int) -> LayerState:
        h, residual, rope = state
        for layer in self.model.layers[start:end]:
            h, residual = layer(h, residual, rope, kv_cache)
        return LayerState(h, residual, rope)

    def final_norm(self, state: LayerState) -> torch.Tensor:
        return self.model.norm(state.h, state.residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits [rows, vocab] in the model dtype (enough for an argmax, which float32 would not change);
        with tensor parallelism gathered on rank 0 (other ranks get None)."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = self.ops.linear(hidden, weight, None)
        return logits if self._tp is None else self._tp.gather_last_dim(logits, self._vocab_sizes)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits, what sampling and scoring work on (None on tensor-parallel ranks other than 0)."""
        logits = self.logits(hidden)
        return None if logits is None else logits.float()

    # -- weights -------------------------------------------------------------------------

    def weight_shards(self) -> dict[str, tuple[WeightShard, ...]]:
        """HF name -> the pieces (WeightShards) of every weight the checkpoint must provide.

        Shapes come from the config, not the parameters, so weights can be
        checked while the parameters are released (asleep).
        """
        cfg, sh = self.config, self.shard
        h, q, kv, vocab = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.vocab_size
        d = cfg.head_dim
        q_start, q_len = sh.heads[0] * d, sh.num_heads * d
        kv_start, kv_len = sh.kv_heads[0] * d, sh.num_kv_heads * d
        shards: dict[str, tuple[WeightShard, ...]] = {
            "model.embed_tokens.weight": (WeightShard(self.model.embed_tokens.weight, 0, (vocab, h), 0, *sh.vocab),),
            "model.norm.weight": (WeightShard(self.model.norm.weight, 0, (h,)),),
        }
        if self.lm_head is not None:
            shards["lm_head.weight"] = (WeightShard(self.lm_head.weight, 0, (vocab, h), 0, *sh.vocab),)
        for i, layer in enumerate(self.model.layers):
            pre = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            shards[pre + "input_layernorm.weight"] = (WeightShard(layer.input_layernorm.weight, 0, (h,)),)
            shards[pre + "post_attention_layernorm.weight"] = (
                WeightShard(layer.post_attention_layernorm.weight, 0, (h,)),)
            shards[pre + "self_attn.o_proj.weight"] = (WeightShard(attn.o_proj.weight, 0, (h, q), 1, q_start, q_len),)
            if cfg.qk_norm and cfg.qk_norm_whole:  # OLMoE: one weight per channel, split with the heads
                shards[pre + "self_attn.q_norm.weight"] = (WeightShard(attn.q_norm.weight, 0, (q,), 0, q_start, q_len),)
                shards[pre + "self_attn.k_norm.weight"] = (
                    WeightShard(attn.k_norm.weight, 0, (kv,), 0, kv_start, kv_len),)
            elif cfg.qk_norm:  # one [head_dim] weight per layer, the same on every tensor-parallel rank
                shards[pre + "self_attn.q_norm.weight"] = (WeightShard(attn.q_norm.weight, 0, (d,)),)
                shards[pre + "self_attn.k_norm.weight"] = (WeightShard(attn.k_norm.weight, 0, (d,)),)
            params = [("weight", attn.qkv_proj.weight, (h,))]
            if cfg.attention_bias:
                params.append(("bias", attn.qkv_proj.bias, ()))
            for kind, p, rest in params:
                pieces = {"q_proj": WeightShard(p, 0, (q, *rest), 0, q_start, q_len),
                          "k_proj": WeightShard(p, q_len, (kv, *rest), 0, kv_start, kv_len),
                          "v_proj": WeightShard(p, q_len + kv_len, (kv, *rest), 0, kv_start, kv_len)}
                if cfg.fused_checkpoint:  # rows q, then k, then v of one tensor
                    fused = (q + 2 * kv, *rest)
                    shards[pre + f"self_attn.qkv_proj.{kind}"] = tuple(
                        w.within(fused, offset) for w, offset in zip(pieces.values(), (0, q, q + kv)))
                else:
                    shards |= {pre + f"self_attn.{n}.{kind}": (w,) for n, w in pieces.items()}
            shards |= self.mlp_shards(pre, mlp)
        return shards

    def mlp_shards(self, pre: str, mlp: nn.Module) -> dict[str, tuple[WeightShard, ...]]:
        """The weights of one layer's feed-forward block (a mixture-of-experts variant names its experts)."""
        h, inter = self.config.hidden_size, self.config.intermediate_size
        i_start, i_len = self.shard.intermediate
        gate = WeightShard(mlp.gate_up_proj.weight, 0, (inter, h), 0, i_start, i_len)
        up = WeightShard(mlp.gate_up_proj.weight, i_len, (inter, h), 0, i_start, i_len)
        down = WeightShard(mlp.down_proj.weight, 0, (h, inter), 1, i_start, i_len)
        if self.config.fused_checkpoint:  # rows gate, then up
            return {pre + "mlp.gate_up_proj.weight": (gate.within((2 * inter, h), 0), up.within((2 * inter, h), inter)),
                    pre + "mlp.down_proj.weight": (down,)}
        return {pre + "mlp.gate_proj.weight": (gate,), pre + "mlp.up_proj.weight": (up,),
                pre + "mlp.down_proj.weight": (down,)}

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """The weights under the checkpoint's names (a variant maps other spellings of them here)."""
        return iter(weights)

    def _target(self, shards: dict[str, tuple[WeightShard, ...]], name: str, tensor: torch.Tensor,
                full_only: bool = True) -> tuple[WeightShard, ...]:
        """Where ``name`` goes (its pieces), after checking its shape and dtype: the checkpoint's full shape,
        or (unless ``full_only``) this tensor-parallel rank's own slice of it."""
        if not isinstance(tensor, torch.Tensor):
            raise ModelLoadError(f"weight {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if name not in shards:
            raise ModelLoadError(f"unexpected weight {name!r}: no such parameter in this {self.config.architecture} model")
        pieces = shards[name]
        if tuple(tensor.shape) != pieces[0].shape:
            sliced = None if full_only else rank_slice(pieces)
            if sliced is None or tuple(tensor.shape) != sliced[0].shape:
                also = f" (or this rank's slice, {sliced[0].shape})" if sliced is not None else ""
                raise ModelLoadError(f"weight {name!r} has shape {tuple(tensor.shape)}, expected {pieces[0].shape}"
                                     f"{also}")
            pieces = sliced
        if not tensor.is_floating_point():
            raise ModelLoadError(f"weight {name!r} has dtype {tensor.dtype}, expected a floating-point tensor")
        return pieces

    def _check_complete(self, shards: dict, loaded: set[str]) -> None:
        missing = sorted(set(shards) - loaded)
        if missing:
            more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
            raise ModelLoadError(f"checkpoint is missing weights: {', '.join(missing[:5])}{more}")

    def check_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_all: bool = True,
                      full_only: bool = True) -> None:
        """Validate names, shapes and dtypes without copying anything (for all-or-nothing updates);
        ``full_only=False`` also takes this rank's slice of a split tensor (pushed to a launched rank)."""
        shards = self.weight_shards()
        names = set()
        for name, tensor in self.checkpoint_names(weights):
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            self._target(shards, name, tensor, full_only)
            names.add(name)
        if require_all:
            self._check_complete(shards, names)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], require_all: bool = False,
                     full_only: bool = True) -> set[str]:
        """Copy HF-named tensors (this rank's slice of each) into the (fused) parameters; returns the names loaded.

        Unknown names, shape mismatches and (with ``require_all``) missing names
        raise ModelLoadError naming the tensor. Without ``require_all`` any subset
        loads, as vLLM's ``model.load_weights`` does (a ``collective_rpc`` function
        pushing one tensor at a time). A checkpoint's tensors must
        have their full shapes; ``full_only=False`` also takes a rank's slice. Parameters must be placed
        (materialized) first: with a ``weight_status`` whose memory sleeps, EngineSleepingError.
        """
        status = self.weight_status
        if status is not None:
            status.before_load()
        shards = self.weight_shards()
        loaded: set[str] = set()
        for name, tensor in self.checkpoint_names(weights):
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied head: some checkpoints store the copy anyway
            for shard in self._target(shards, name, tensor, full_only):
                shard.copy_(tensor)
            loaded.add(name)
            if status is not None:
                status.loaded(name)
        if require_all:
            self._check_complete(shards, loaded)
        return loaded
