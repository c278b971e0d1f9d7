"""Reference paged attention in plain torch: the CPU path and the ground truth for kernels.

Queries of all sequences are padded into [B, max_query_len], keys are gathered
through the block tables into [B, max_seq_len], and one masked SDPA call does
causal, variable-length, GQA attention for prefill and decode alike.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .metadata import AttentionMetadata


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write this step's keys/values [T, kv_heads, head_dim] into their cache slots."""
    kv_heads, head_dim = k_cache.shape[-2:]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _masked_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """SDPA over padded [B, L, heads, D] tensors with a boolean [B, Lq, Lk] mask; GQA by repetition."""
    num_heads, kv_heads = queries.shape[2], keys.shape[2]
    if kv_heads != num_heads:
        keys = keys.repeat_interleave(num_heads // kv_heads, dim=2)
        values = values.repeat_interleave(num_heads // kv_heads, dim=2)
    out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=mask[:, None], scale=scale)  # [B, H, Lq, D]
    return out.transpose(1, 2)


def paged_attention_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Attention output [T, heads, head_dim] for flat queries q [T, heads, head_dim].

    k_cache/v_cache: [num_blocks, block_size, kv_heads, head_dim]. ``window``
    (sliding-window layers): a query at position p sees keys p - window < k <= p.
    """
    head_dim = q.shape[2]
    batch = meta.block_tables.shape[0]
    kv_heads = k_cache.shape[2]
    keys = k_cache[meta.block_tables].reshape(batch, -1, kv_heads, head_dim)[:, : meta.max_seq_len]
    values = v_cache[meta.block_tables].reshape(batch, -1, kv_heads, head_dim)[:, : meta.max_seq_len]
    key_pos = torch.arange(meta.max_seq_len, device=q.device)
    # Slots past a sequence's length (and padding blocks) were never written: a freshly allocated
    # cache may hold NaN/inf there, which a mask alone does not neutralise (NaN * 0 = NaN).
    written = (key_pos[None, :] < meta.seq_lens[:, None])[:, :, None, None]
    keys = torch.where(written, keys, 0.0)
    values = torch.where(written, values, 0.0)
    mask = (key_pos[None, None, :] <= meta.q_positions[:, :, None]) & (
        key_pos[None, None, :] < meta.seq_lens[:, None, None]
    )
    if window is not None:
        mask &= key_pos[None, None, :] > meta.q_positions[:, :, None] - window
    return _masked_attention(q[meta.q_index], keys, values, mask, scale)[meta.q_valid]


def causal_attention_dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                           scale: float, window: int | None = None) -> torch.Tensor:
    """KV-free causal attention of complete sequences: keys are this step's own tokens."""
    pos = meta.q_positions
    mask = (pos[:, None, :] <= pos[:, :, None]) & meta.q_valid[:, None, :]
    if window is not None:
        mask &= pos[:, None, :] > pos[:, :, None] - window
    return _masked_attention(q[meta.q_index], k[meta.q_index], v[meta.q_index], mask, scale)[meta.q_valid]
