"""Per-batch attention metadata and the scoped context that carries it to the layers."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Where each query token of a flattened batch sits, and where its keys live.

    The batch is a flat run of T query tokens: sequence ``b`` owns tokens
    ``query_start_loc[b]:query_start_loc[b+1]``, which are the last query
    tokens of its ``seq_lens[b]`` context tokens. Keys/values of token ``t``
    are written to cache slot ``slot_mapping[t]`` (block * block_size + offset).

    Without ``slot_mapping``/``block_tables`` the batch is KV-free: every
    sequence is complete in this step (pooling), keys come from the step
    itself and nothing is written to the cache.

    Device tensors, created per step and dropped when the step's context ends.
    """

    slot_mapping: torch.Tensor | None  # [T] int64 (negative: write nothing); None: KV-free
    query_start_loc: torch.Tensor  # [B+1]
    seq_lens: torch.Tensor  # [B], context length after this step
    block_tables: torch.Tensor | None  # [B, max_blocks]; None: KV-free
    max_query_len: int
    max_seq_len: int
    # Gather maps of the padded torch reference path: query token (b, i) is flat token q_index[b, i].
    q_index: torch.Tensor | None = None  # [B, max_query_len] int64
    q_valid: torch.Tensor | None = None  # [B, max_query_len] bool
    q_positions: torch.Tensor | None = None  # [B, max_query_len] int64 (absolute positions; 0 for padding)
    # Work list of the Triton kernel (see tile_shape / list_tiles).
    tile_seq: torch.Tensor | None = None  # [tiles]
    tile_q0: torch.Tensor | None = None  # [tiles]
    block_q: int = 1
    block_m: int = 16
    splits: int = 1  # programs sharing one decode tile's keys (see tile_splits)
    # Zeroed int32 arrival counters with which split kernels finish their reduction in-kernel (Triton path).
    counters: torch.Tensor | None = None


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def tile_shape(group: int, max_query_len: int, batch_invariant: bool = False) -> tuple[int, int]:
    """(BLOCK_Q, BLOCK_M) of the Triton attention kernel: query tokens per tile, rows per tile.

    A tile holds ``BLOCK_Q`` query tokens times the ``group`` query heads that
    share a KV head. Decode batches take one token per tile (padded to the 16
    rows ``tl.dot`` needs); anything longer takes 64-row tiles. ``batch_invariant``:
    decode tiles take the 64 rows of the others too. The row sums of a tile
    follow its dot's register layout (16 and 64 rows differ on the H200), so a
    token decoded in a 16-row tile and verified or prefilled in a 64-row tile
    got different bits at 2 of 16 positions.
    """
    block_m = max(64, _next_power_of_2(group))
    if max_query_len == 1:
        return 1, block_m if batch_invariant else max(16, _next_power_of_2(group))
    return block_m // group, block_m


def tile_splits(num_seqs: int, num_kv_heads: int, block_q: int, batch_invariant: bool = False,
                target_programs: int = 256) -> int:
    """How many programs share each tile's keys: for decode tiles (``block_q == 1``) enough (a power
    of two, at most 16) that a small batch still runs about ``target_programs`` programs; otherwise 1.

    ``batch_invariant``: always 1. A split adds partial softmaxes in another order than one program
    does, so a row's bits would depend on the number of sequences in the step (which sets the split)
    and on whether it is decoded or verified/prefilled (split or not)."""
    splits = 1
    while (block_q == 1 and not batch_invariant and splits < 16
           and num_seqs * num_kv_heads * splits < target_programs):
        splits *= 2
    return splits


def list_tiles(query_lens: list[int], block_q: int) -> tuple[list[int], list[int]]:
    """(sequence index, first query token) of every tile of a batch."""
    seqs: list[int] = []
    starts: list[int] = []
    for b, n in enumerate(query_lens):
        for q0 in range(0, n, block_q):
            seqs.append(b)
            starts.append(q0)
    return seqs, starts


class ForwardContext:
    """Holds the current batch's metadata while, and only while, a forward pass runs.

    One per runner. ``scope`` sets it in a ``with`` block and clears it in
    ``finally``, so no step's tensors outlive the step and a layer called
    outside a forward pass fails loudly instead of reading stale metadata.
    """

    def __init__(self) -> None:
        self._metadata: AttentionMetadata | None = None

    @property
    def metadata(self) -> AttentionMetadata:
        if self._metadata is None:
            raise RuntimeError("attention layer called outside a ForwardContext scope")
        return self._metadata

    @property
    def split_counters(self) -> torch.Tensor | None:
        """The current step's arrival counters (None outside a step, or on the torch path)."""
        return None if self._metadata is None else self._metadata.counters

    @contextmanager
    def scope(self, metadata: AttentionMetadata) -> Iterator[None]:
        self._metadata = metadata
        try:
            yield
        finally:
            self._metadata = None
