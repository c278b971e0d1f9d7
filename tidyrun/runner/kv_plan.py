"""How big the KV cache is and how long a sequence may be, decided before the model exists.

A pure function of the configs and one memory reading: the model's RoPE
table, the step buffers and the scheduler are all sized from
``KVPlan.max_model_len``, so it is fixed first and never changed afterwards
(before, a CUDA engine shrank ``max_model_len`` after loading its weights,
when the table had already been built for the old length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import EngineConfig, ModelConfig
from ..errors import InvalidRequestError, OutOfResourcesError
from ..kv_cache import bytes_per_block
from ..model.registry import skeleton
from ..model.sharding import TPShard
from .weights import aligned_numel

CPU_KV_BUDGET = 1 << 30  # 1 GiB unless the user says otherwise; pages are only touched when used
# Left free on the GPU beyond what is computed: the CUDA context's growth, cuBLAS/Triton workspaces.
GPU_HEADROOM = 512 << 20


@dataclass(frozen=True)
class KVPlan:
    num_blocks: int
    max_model_len: int
    weight_bytes: int  # this rank's weights, as the WeightArena will lay them out


def weight_numels(mc: ModelConfig, shard: TPShard) -> list[int]:
    """Element counts of this rank's parameters, read off the model built on the meta device."""
    return [p.numel() for p in skeleton(mc, shard).parameters()]


def weight_bytes(mc: ModelConfig, shard: TPShard, dtype: torch.dtype) -> int:
    """Bytes of the WeightArena of this rank, laid out as the arena lays out its parameters."""
    elem = torch.empty((), dtype=dtype).element_size()
    return sum(aligned_numel(n, dtype) for n in weight_numels(mc, shard)) * elem


def resolve_max_model_len(mc: ModelConfig, config: EngineConfig) -> int:
    limit = mc.max_position_embeddings
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise InvalidRequestError(f"max_model_len={config.max_model_len} exceeds the model's context length ({limit})")
    return config.max_model_len


def activation_bytes(mc: ModelConfig, config: EngineConfig, dtype: torch.dtype) -> int:
    """Peak activations of the largest step, plus float32 logits/sort buffers of a full batch."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_token = 6 * mc.hidden_size + 4 * mc.intermediate_size + mc.q_size + 2 * mc.kv_size
    if mc.num_experts:  # each of a token's k experts: its gate/up rows, their product, its down output
        per_token += mc.num_experts_per_tok * (3 * mc.moe_intermediate_size + mc.hidden_size)
    return config.max_num_batched_tokens * per_token * elem + config.max_num_seqs * mc.vocab_size * 4 * 4


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def gpu_kv_budget(util: float, free: int, total: int, weights: int, activations: int) -> int:
    """KV cache bytes under vLLM's ``gpu_memory_utilization``: this engine's share of the whole device.

    The engine may use ``util * total`` bytes, its weights, activations,
    graphs and workspaces included; what others hold (a colocated trainer,
    another engine) is not charged to it, so TRL's 0.3 beside a trainer
    means 30% of the card, not 30% minus the trainer. That share must be
    free now, though: asking for more than is free fails here, saying how
    much others hold, instead of running out of memory later.
    """
    allowed, others = int(util * total), total - free
    if allowed > free:
        raise OutOfResourcesError(
            f"gpu_memory_utilization={util} asks for {_gib(allowed)} of the {_gib(total)} device, but only "
            f"{_gib(free)} are free (others hold {_gib(others)}); lower it or free memory")
    budget = allowed - weights - activations - GPU_HEADROOM
    if budget <= 0:
        raise OutOfResourcesError(
            f"gpu_memory_utilization={util} gives this engine {_gib(allowed)} of the {_gib(total)} device, but its "
            f"weights take {_gib(weights)}, activations {_gib(activations)} and workspaces {_gib(GPU_HEADROOM)}: "
            "no device memory left for the KV cache; raise gpu_memory_utilization or lower max_num_batched_tokens")
    return budget


def plan_kv_cache(mc: ModelConfig, shard: TPShard, config: EngineConfig, dtype: torch.dtype,
                  gpu_memory: tuple[int, int] | None) -> KVPlan:
    """Blocks and context length from the configs and, on CUDA, ``gpu_memory`` = (free, total) read
    before anything of this engine was allocated (None on the CPU).

    The KV cache gets ``num_blocks`` blocks if given, else ``memory_bytes``
    (vLLM's ``kv_cache_memory_bytes``: the fraction is then not used; on
    CUDA the weights and that cache must fit in the free memory), else, on
    CUDA, what ``gpu_memory_utilization`` leaves (``gpu_kv_budget``), else
    (CPU) 1 GiB; never more than ``max_num_seqs`` full contexts. With no
    ``max_model_len`` given and too little memory for the model's full
    context, the context shrinks to what the cache holds.
    """
    max_model_len = resolve_max_model_len(mc, config)
    cache = config.cache
    weights = weight_bytes(mc, shard, dtype)
    per_block = bytes_per_block(mc.num_layers, cache.block_size, shard.num_kv_heads, mc.head_dim, dtype)
    blocks_per_seq = -(-max_model_len // cache.block_size)
    if cache.num_blocks is not None:
        num_blocks = cache.num_blocks
    else:
        if cache.memory_bytes is not None:
            budget = cache.memory_bytes
        elif gpu_memory is None:
            budget = CPU_KV_BUDGET
        else:
            budget = gpu_kv_budget(cache.gpu_memory_utilization, *gpu_memory, weights,
                                   activation_bytes(mc, config, dtype))
        num_blocks = min(budget // per_block, blocks_per_seq * config.max_num_seqs)
    if gpu_memory is not None and (cache.num_blocks is not None or cache.memory_bytes is not None):
        check_fits(num_blocks * per_block, weights, *gpu_memory,
                   f"num_kv_blocks={num_blocks}" if cache.num_blocks is not None
                   else f"kv_cache_memory={cache.memory_bytes}")
    if num_blocks * cache.block_size < max_model_len:
        if config.max_model_len is not None or num_blocks < 1:
            raise OutOfResourcesError(
                f"the KV cache holds {num_blocks} blocks ({num_blocks * cache.block_size} tokens), less than one "
                f"sequence of max_model_len={max_model_len} tokens; give it more memory or lower max_model_len")
        max_model_len = num_blocks * cache.block_size
    return KVPlan(int(num_blocks), int(max_model_len), weights)


def check_fits(kv: int, weights: int, free: int, total: int, asked: str) -> None:
    """Refuse a KV cache the caller sized (``asked``: the keyword and its value) that cannot fit beside the
    weights in the device's free memory, before anything is allocated. Not left to the allocation's own
    failure: a cudaMalloc that fails makes the CUDA driver give back memory it held for the whole process, not
    torch's and not this engine's (20 MiB on an H100 after the GPU suite's async tests), so the driver-level
    reading of a failed start would no longer compare with the one before it."""
    if weights + kv > free:
        raise OutOfResourcesError(
            f"{asked} gives a KV cache of {_gib(kv)}; with the weights' {_gib(weights)} that needs "
            f"{_gib(weights + kv)}, but only {_gib(free)} of the {_gib(total)} device are free (others hold "
            f"{_gib(total - free)}); lower it or free memory")


def check_agreed_blocks(plan: KVPlan, agreed: int, block_size: int) -> None:
    """Tensor-parallel ranks use the least block count of all; it must still hold one full sequence."""
    if agreed * block_size < plan.max_model_len:
        raise OutOfResourcesError(
            f"the tensor-parallel ranks agreed on {agreed} KV blocks ({agreed * block_size} tokens), less than "
            f"one sequence of max_model_len={plan.max_model_len}; another rank planned fewer blocks (a smaller "
            "device): lower max_model_len or raise gpu_memory_utilization")
