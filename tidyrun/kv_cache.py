"""Paged KV cache: the device tensor that holds keys/values, and the host-side block pool.

Blocks are fixed-size runs of ``block_size`` token slots. A sequence owns a
block table (list of block ids); slot ``block * block_size + offset`` holds
the key/value of one token in every layer.
"""

from __future__ import annotations

from collections import deque

import torch

from .errors import OutOfResourcesError
from .resources import ResourceLedger


class BlockPool:
    """Free list of KV block ids. Host-only bookkeeping; owns no device memory."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfResourcesError(f"asked for {n} KV blocks, {len(self._free)} free")
        return [self._free.popleft() for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


class KVCache:
    """Keys and values of every layer: one device tensor [layers, 2, blocks, block_size, kv_heads, head_dim].

    Owns device memory: the cache tensor, registered with the ledger as
    ``kv_cache`` where it is allocated. One allocation (not one per layer)
    keeps start-up fast and makes an over-budget request fail before anything
    was half-allocated.
    """

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, ledger: ResourceLedger) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        try:
            self.tensor = ledger.track("kv_cache", "kv_cache", torch.empty(shape, dtype=dtype, device=device))
        except (torch.OutOfMemoryError, RuntimeError) as exc:  # CUDA OOM, or the CPU allocator's RuntimeError
            if not isinstance(exc, torch.OutOfMemoryError) and "memory" not in str(exc):
                raise
            raise OutOfResourcesError(
                f"cannot allocate a KV cache of {num_blocks} blocks x {block_size} tokens "
                f"({bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype) * num_blocks / 2**20:.0f} MiB) "
                f"on {device}: {exc}"
            ) from exc

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_cache, v_cache) views of layer ``i``, each [blocks, block_size, kv_heads, head_dim]."""
        return self.tensor[i, 0], self.tensor[i, 1]


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return num_layers * 2 * block_size * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
