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

    slot_mapping: torch.Tensor | None  # [T] int64; None: KV-free
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32, context length after this step
    block_tables: torch.Tensor | None  # [B, max_blocks] int32; None: KV-free
    max_query_len: int
    max_seq_len: int
    # Gather maps for the padded reference path: query token (b, i) is flat token q_index[b, i].
    q_index: torch.Tensor  # [B, max_query_len] int64
    q_valid: torch.Tensor  # [B, max_query_len] bool
    q_positions: torch.Tensor  # [B, max_query_len] int64 (absolute positions; 0 for padding)


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

    @contextmanager
    def scope(self, metadata: AttentionMetadata) -> Iterator[None]:
        self._metadata = metadata
        try:
            yield
        finally:
            self._metadata = None
