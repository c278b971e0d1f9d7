"""Pooling: hidden states of complete prompts, reduced to one vector each (embeddings, scoring).

Runs the model KV-free: every sequence is whole in one forward pass, so no
KV block is allocated or written. Holds no device memory between calls; the
per-call tensors die with the call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import AttentionMetadata
from ..errors import InvalidRequestError

POOLING_METHODS = ("last", "mean", "cls")


def dense_batch(token_lists: list[list[int]], device: torch.device):
    """Flat input ids and positions plus KV-free metadata for complete sequences."""
    lengths = [len(t) for t in token_lists]
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    batch, longest = len(lengths), max(lengths)
    rank = torch.arange(longest)
    q_valid = rank[None, :] < torch.tensor(lengths)[:, None]
    q_index = torch.where(q_valid, torch.tensor(starts[:-1])[:, None] + rank[None, :], 0)
    q_positions = torch.where(q_valid, rank[None, :].expand(batch, longest), 0)
    meta = AttentionMetadata(
        slot_mapping=None, block_tables=None,
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
        max_query_len=longest, max_seq_len=longest,
        q_index=q_index.to(device), q_valid=q_valid.to(device), q_positions=q_positions.to(device),
    )
    input_ids = torch.tensor([t for ids in token_lists for t in ids], dtype=torch.int64, device=device)
    positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
    return input_ids, positions, meta, starts


def pool(hidden: torch.Tensor, starts: list[int], method: str) -> torch.Tensor:
    """One float32 row per sequence from flat hidden states [T, H]."""
    if method == "last":
        return hidden[[e - 1 for e in starts[1:]]].float()
    if method == "cls":
        return hidden[starts[:-1]].float()
    if method == "mean":
        return torch.stack([hidden[s:e].float().mean(0) for s, e in zip(starts[:-1], starts[1:])])
    raise InvalidRequestError(f"pooling must be one of {POOLING_METHODS}, got {method!r}")


def chunks_by_tokens(token_lists: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Indices of ``token_lists`` grouped so each group has at most ``max_tokens`` tokens (or one sequence)."""
    groups, current, size = [], [], 0
    for i, ids in enumerate(token_lists):
        if current and size + len(ids) > max_tokens:
            groups.append(current)
            current, size = [], 0
        current.append(i)
        size += len(ids)
    if current:
        groups.append(current)
    return groups


def normalize(vectors: torch.Tensor) -> torch.Tensor:
    return F.normalize(vectors, p=2, dim=-1)
