"""Paged KV cache: the device tensor that holds keys/values, and the host-side block pool.

Blocks are fixed-size runs of ``block_size`` token slots. A sequence owns a
block table (list of block ids); slot ``block * block_size + offset`` holds
the key/value of one token in every layer.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple

import torch

from .errors import OutOfResourcesError
from .resources import ResourceLedger


def prefix_digest(parent: bytes, tokens: Sequence[int]) -> bytes:
    """sha256 of a block's parent digest and its token ids: the block's place in a hash chain that covers
    every token before it. Why not Python's 64-bit ``hash()``: on a shared server a collision would serve
    one user's keys and values to another (vLLM moved to sha256 after such an advisory); the pool also
    checks the tokens of every hit, so even a collision is never reused."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


class BlockKey(NamedTuple):
    """What identifies a full block's contents: its chain digest, its parent's digest (b"" for the first
    block) and its own tokens (checked on every hit)."""
    digest: bytes
    parent: bytes
    tokens: tuple[int, ...]


class BlockPool:
    """KV block ids: reference counts, an LRU free queue, and the prefix cache.

    A full block whose keys/values are computed is registered under its
    ``BlockKey`` (the sha256 chain of its tokens and every token before
    it), so a later sequence with the same prefix reuses the block instead
    of recomputing it; a hit counts only if the stored tokens and parent
    equal the asking sequence's. A block nobody
    references goes to the tail of the free queue but keeps its cached
    contents until it is handed out again (from the head: least recently
    freed first). Host-only bookkeeping; owns no device memory.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._key_of: list[BlockKey | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # chain digest -> block id
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (cached-but-unreferenced ones included)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfResourcesError(f"asked for {n} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(n):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; unreferenced ones join the free queue, the last block first
        (so a sequence's tail, the least shareable part, is evicted before its prefix)."""
        for block in reversed(blocks):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                self._free[block] = None

    def lookup(self, keys: list[BlockKey]) -> list[int]:
        """The cached blocks of the longest prefix of ``keys`` (a sequence's consecutive full blocks), each
        verified token for token and parent for parent."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for key in keys:
            block = self._cached.get(key.digest)
            if block is None or self._key_of[block] != key:
                break
            hits.append(block)
        return hits

    def num_unreferenced(self, blocks: list[int]) -> int:
        return sum(1 for b in blocks if self._ref[b] == 0)

    def share(self, blocks: list[int]) -> None:
        """Take a reference to cached blocks (leaving the free queue if they were in it)."""
        for block in blocks:
            if self._ref[block] == 0:
                del self._free[block]
            self._ref[block] += 1

    def register(self, block: int, key: BlockKey) -> None:
        """Mark a full, computed block as holding the prefix ``key`` names."""
        if self.enable_prefix_caching and key.digest not in self._cached and self._key_of[block] is None:
            self._cached[key.digest] = block
            self._key_of[block] = key

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix (the KV contents are gone or stale: sleep, new weights)."""
        self._cached.clear()
        self._key_of = [None] * self.num_blocks

    def _evict(self, block: int) -> None:
        key = self._key_of[block]
        if key is not None:
            del self._cached[key.digest]
            self._key_of[block] = None


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
