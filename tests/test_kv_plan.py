"""plan_kv_cache with vLLM's gpu_memory_utilization: this engine's share of the whole device, others' memory
not charged to it but required to be free; kv_cache_memory overrides the fraction. Fake (free, total) readings."""

from __future__ import annotations

import pytest
import torch

from tidyrun.config import CacheConfig, EngineConfig, ModelConfig
from tidyrun.errors import OutOfResourcesError
from tidyrun.kv_cache import bytes_per_block
from tidyrun.model.sharding import TPShard
from tidyrun.runner.kv_plan import CPU_KV_BUDGET, GPU_HEADROOM, activation_bytes, plan_kv_cache, weight_bytes

GIB = 2**30
# A Llama-3.2-1B-like shape; max_num_seqs high enough that memory, not the sequence count, bounds the cache.
MC = ModelConfig("llama", 32000, 2048, 8192, 16, 32, 8, 64, 1e-5, 5e5, 4096, True)
SHARD = TPShard.of(MC)
DTYPE = torch.bfloat16


def config(**cache) -> EngineConfig:
    return EngineConfig(max_num_seqs=4096, cache=CacheConfig(**cache))


def plan(free_gib: float, total_gib: float = 140, **cache):
    return plan_kv_cache(MC, SHARD, config(**cache), DTYPE, (int(free_gib * GIB), int(total_gib * GIB)))


def per_block() -> int:
    return bytes_per_block(MC.num_layers, 16, SHARD.num_kv_heads, MC.head_dim, DTYPE)


def test_the_budget_is_a_share_of_the_whole_device_weights_included():
    weights = weight_bytes(MC, SHARD, DTYPE)
    expected = (int(0.5 * 140 * GIB) - weights - activation_bytes(MC, config(), DTYPE) - GPU_HEADROOM) // per_block()
    assert plan(140, gpu_memory_utilization=0.5).num_blocks == expected
    assert plan(140, gpu_memory_utilization=0.5).weight_bytes == weights > GIB


def test_memory_others_hold_is_not_charged_to_the_budget():
    alone = plan(140, gpu_memory_utilization=0.3)
    beside_a_trainer = plan(80, gpu_memory_utilization=0.3)  # TRL colocate: a trainer holds 60 GiB
    assert beside_a_trainer.num_blocks == alone.num_blocks > 0


def test_a_share_that_is_not_free_fails_at_start_up_saying_who_holds_what():
    with pytest.raises(OutOfResourcesError,
                       match=r"gpu_memory_utilization=0.3 asks for 42.00 GiB of the 140.00 GiB device, but only "
                             r"40.00 GiB are free \(others hold 100.00 GiB\); lower it or free memory"):
        plan(40, gpu_memory_utilization=0.3)
    with pytest.raises(OutOfResourcesError, match="asks for 126.00 GiB"):
        plan(100)  # the default 0.9 beside a 40 GiB trainer
    assert plan(42.01, gpu_memory_utilization=0.3).num_blocks == plan(140, gpu_memory_utilization=0.3).num_blocks


def test_a_share_too_small_for_the_weights_names_them():
    with pytest.raises(OutOfResourcesError, match=r"gives this engine 1.40 GiB .* weights take .*no device memory "
                                                  r"left for the KV cache"):
        plan(140, gpu_memory_utilization=0.01)


def test_kv_cache_memory_overrides_the_fraction():
    # The fraction would be refused (0.9 of the device is not free); kv_cache_memory does not use it.
    p = plan(100, memory_bytes=4 * GIB)
    assert p.num_blocks == 4 * GIB // per_block()
    with pytest.raises(OutOfResourcesError, match=r"kv_cache_memory=.* only 3.00 GiB of the 140.00 GiB device are "
                                                  r"free \(others hold 137.00 GiB\)"):
        plan(3, memory_bytes=4 * GIB)


def test_the_cpu_and_a_fixed_block_count_need_no_reading():
    cpu = plan_kv_cache(MC, SHARD, config(), DTYPE, None)
    assert cpu.num_blocks == CPU_KV_BUDGET // per_block()
    assert plan(4, num_blocks=300).num_blocks == 300  # the user's count is taken as given


def test_a_fixed_block_count_that_cannot_fit_is_refused_before_any_allocation():
    """Checked by arithmetic, not left to the allocation: a failed cudaMalloc makes the driver give back memory
    it held for the whole process (20 MiB on an H100), which test_gpu_lifecycle's failed start then read as
    not returned to its baseline."""
    weights = weight_bytes(MC, SHARD, DTYPE)
    fits = (4 * GIB - weights) // per_block()
    assert plan(4, num_blocks=fits).num_blocks == fits
    with pytest.raises(OutOfResourcesError, match=rf"num_kv_blocks={fits + 1} gives a KV cache of .* only 4.00 GiB "
                                                  r"of the 140.00 GiB device are free"):
        plan(4, num_blocks=fits + 1)
