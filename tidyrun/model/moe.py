"""Mixture-of-experts decoders (Mixtral, Qwen3-MoE, OLMoE): Llama's skeleton with a routed feed-forward block.

Each token's MLP output is the weighted sum of ``k`` SwiGLU experts out of
``E``: a router (one [E, hidden] matrix) scores the experts, the softmax of
the scores is taken in float32, the top ``k`` are kept and (Mixtral always,
Qwen3-MoE and OLMoE when ``norm_topk_prob``) rescaled to sum to 1. The
families differ only in that normalisation, in names, and in their
attention: Qwen3-MoE norms each query/key head (as Qwen3), OLMoE the whole
projection (``ModelConfig.qk_norm_whole``).

Every expert's weights are stacked into two parameters per layer, ``w13``
[E, 2I, hidden] (each expert's gate rows, then its up rows) and ``w2``
[E, hidden, I]: they live in the runner's weight arena with every other
parameter and are read by one grouped kernel on the GPU
(``ops.moe_experts``). Tensor parallelism splits every expert by
intermediate channel, as the dense MLP is split; the router is replicated.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from ..config import ModelConfig
from .layers import Linear, _param
from .llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaModel, WeightShard
from .ops import TorchOps
from .sharding import TPShard


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], expert ids int64 [T, k]): the top ``k`` of the float32 softmax, as transformers
    routes (ties go to the lower expert id, as torch.topk breaks them)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoE(nn.Module):
    """The routed feed-forward block: router, then ``ops.moe_experts`` over the stacked expert weights."""

    def __init__(self, cfg: ModelConfig, ops: TorchOps, dtype, shard: TPShard, tp=None):
        super().__init__()
        self._ops = ops
        self._tp = tp
        self.top_k, self.renormalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        # Qwen3-MoE and OLMoE round the routing weights to the model dtype before they scale the experts'
        # outputs; Mixtral keeps them in float32 (transformers' routers).
        self._round_weights = cfg.architecture != "mixtral"
        inter = shard.expert_intermediate[1]
        self.gate = Linear(cfg.hidden_size, cfg.num_experts, False, ops, dtype)
        self.w13 = _param(cfg.num_experts, 2 * inter, cfg.hidden_size, dtype=dtype)
        self.w2 = _param(cfg.num_experts, cfg.hidden_size, inter, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        if self._round_weights:
            weights = weights.to(x.dtype)
        out = self._ops.moe_experts(x, self.w13, self.w2, weights, ids)
        return out if self._tp is None else self._tp.all_reduce(out)


class MoEDecoderLayer(LlamaDecoderLayer):
    def build_mlp(self, cfg: ModelConfig, layer_idx: int, ops: TorchOps, dtype, shard: TPShard, tp) -> nn.Module:
        if cfg.is_moe_layer(layer_idx):
            return SparseMoE(cfg, ops, dtype, shard, tp)
        return super().build_mlp(cfg, layer_idx, ops, dtype, shard, tp)


class MoEModel(LlamaModel):
    layer_class = MoEDecoderLayer


class MoEForCausalLM(LlamaForCausalLM):
    """A mixture-of-experts model (see the module docstring); everything but the MLP as LlamaForCausalLM.

    Weights come under the checkpoint's per-expert names
    (``mlp.experts.{e}.gate_proj.weight``; Mixtral's
    ``block_sparse_moe.experts.{e}.w1.weight``), or, for ``load_weights``
    and ``update_weights``, under the names of a transformers >= 5 model in
    memory, which stacks them (``mlp.experts.gate_up_proj`` [E, 2I, hidden],
    ``mlp.experts.down_proj`` [E, hidden, I]): what a trainer's
    ``named_parameters()`` yields.
    """

    model_class = MoEModel

    def _checkpoint_layout(self) -> tuple[str, tuple[str, str, str]]:
        """(the block's name in a layer, the gate, up and down projections' names) in this family's checkpoints."""
        if self.config.architecture == "mixtral":
            return "block_sparse_moe", ("w1", "w3", "w2")
        return "mlp", ("gate_proj", "up_proj", "down_proj")

    def mlp_shards(self, pre: str, mlp: nn.Module) -> dict[str, tuple[WeightShard, ...]]:
        if not isinstance(mlp, SparseMoE):
            return super().mlp_shards(pre, mlp)
        cfg = self.config
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        start, length = self.shard.expert_intermediate
        block, names = self._checkpoint_layout()
        block = pre + block
        shards = {block + ".gate.weight": (WeightShard(mlp.gate.weight, 0, (cfg.num_experts, h)),)}
        for e in range(cfg.num_experts):
            gate, up, down = (f"{block}.experts.{e}.{n}.weight" for n in names)
            shards[gate] = (WeightShard(mlp.w13, 0, (inter, h), 0, start, length, e),)
            shards[up] = (WeightShard(mlp.w13, length, (inter, h), 0, start, length, e),)
            shards[down] = (WeightShard(mlp.w2, 0, (h, inter), 1, start, length, e),)
        return shards

    def checkpoint_names(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Per-expert checkpoint names for a transformers model's stacked ones (views, no copies)."""
        inter = self.config.moe_intermediate_size
        block, names = self._checkpoint_layout()
        for name, tensor in weights:
            layer, _, rest = name.rpartition(".mlp.")
            if rest == "gate.weight" and block != "mlp":
                yield f"{layer}.{block}.gate.weight", tensor
            elif rest in ("experts.gate_up_proj", "experts.down_proj") and isinstance(tensor, torch.Tensor) \
                    and tensor.dim() == 3:
                for e, part in enumerate(tensor):
                    pre = f"{layer}.{block}.experts.{e}."
                    if rest == "experts.down_proj":
                        yield pre + f"{names[2]}.weight", part
                    else:  # [gate; up] halves, whole or a rank's slice of each
                        half = part.shape[0] // 2
                        yield pre + f"{names[0]}.weight", part[:half]
                        yield pre + f"{names[1]}.weight", part[half:]
            else:
                yield name, tensor
