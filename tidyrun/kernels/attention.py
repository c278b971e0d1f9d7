"""Paged attention in Triton: one kernel for prefill, chunked prefill, speculative verification and decode.

Why hand-written: the torch reference path gathers every sequence's pages into
a padded dense tensor each step (a full copy of the context), and
FlexAttention compiles through inductor, whose process-wide caches (graphs,
guards, compiled code holding tensor references) outlive the engine
(DESIGN.md). This kernel reads keys/values straight from the pages through
the block tables and keeps no state outside its arguments; what Triton
caches per process is compiled code only (loaded kernel images, which CUDA
keeps until exit whichever library loaded them).

Work split: a *tile* is up to ``BLOCK_Q`` consecutive query tokens of one
sequence; one program handles one tile for one KV head and all the query
heads that share it (GQA), so each key/value page is read once per tile.
The host lists the tiles (``tile_seq``, ``tile_q0``); for a decode batch they
are simply ``arange(batch)`` and ``0``, which is what CUDA graphs capture.
Query token ``j`` of a sequence with ``q_len`` new tokens and ``seq_len``
tokens in all sits at position ``seq_len - q_len + j`` and sees keys
``0..position`` (causal), or with a sliding window ``W`` (a per-layer
argument) keys ``position - W + 1..position``: the tile starts reading at
the first key its first query sees, so a windowed layer reads at most
``W + BLOCK_Q - 1`` keys per tile whatever the context. A sequence with
``seq_len == 0`` (CUDA-graph padding) produces zeros.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue

# Log2(e): the kernel works in base 2 (exp2 is one instruction).
_LOG2E = 1.4426950408889634
# The window of a layer without one: wider than any context, so every causal key is visible.
_NO_WINDOW = 1 << 30


@triton.jit
def _attend_keys(q, q_pos, start, kv_end, m_i, l_i, acc, bt_row, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_ok,
                 scale_log2, window, stride_c_blk, stride_c_slot, stride_c_head,
                 KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """One online-softmax step over keys [start, start + BLOCK_N) of the tile's sequence."""
    keys = start + tl.arange(0, BLOCK_N)
    key_ok = keys < kv_end
    block = tl.load(bt_row + keys // KV_BLOCK, mask=key_ok, other=0).to(tl.int64)
    offs = block * stride_c_blk + (keys % KV_BLOCK) * stride_c_slot + kv_head * stride_c_head
    # Unwritten slots may hold NaN/inf: load them as 0, masking scores alone would give NaN * 0.
    kv_mask = key_ok[:, None] & dim_ok[None, :]
    k = tl.load(k_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    visible = (keys[None, :] <= q_pos[:, None]) & (keys[None, :] > q_pos[:, None] - window) & key_ok[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + offs[:, None] + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr,
    tile_seq_ptr, tile_q0_ptr, query_start_ptr, seq_lens_ptr, block_tables_ptr,
    scale_log2, window,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_blk, stride_c_slot, stride_c_head, stride_bt,
    GROUP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, KV_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, WHILE_LOOP: tl.constexpr,
    SPLITS: tl.constexpr, part_acc_ptr, part_ml_ptr, PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(tile_seq_ptr + tile)
    q0 = tl.load(tile_q0_ptr + tile)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len

    # Row r of the tile is query token q0 + r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_M)
    q_idx = q0 + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = (rows < BLOCK_Q * GROUP) & (q_idx < q_len)
    q_pos = first_pos + q_idx
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < HEAD_DIM
    tok = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + tok[:, None] * stride_q_tok + head[:, None] * stride_q_head + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)

    # Running max starts finite: a row that sees no key in a page must give exp2(-inf - m) = 0, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_end = first_pos + tl.minimum(q0 + BLOCK_Q, q_len)  # keys visible to the tile's last query
    # The first key the tile's first query sees, rounded down to a BLOCK_N boundary: key blocks then start
    # at the same positions for a query whether it is decoded alone or prefilled in a tile (the same bits).
    kv_lo = tl.maximum(first_pos + q0 - window + 1, 0) // BLOCK_N * BLOCK_N
    # With SPLITS > 1 (decode) each program takes one contiguous share of the keys: flash-decoding.
    chunk = tl.cdiv(tl.cdiv(tl.maximum(kv_end - kv_lo, 0), SPLITS), BLOCK_N) * BLOCK_N
    lo = kv_lo + split * chunk
    hi = tl.minimum(kv_end, lo + chunk)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    if WHILE_LOOP:  # Triton's interpreter cannot run a for loop whose bound was loaded from memory
        start = lo
        while start < hi:
            m_i, l_i, acc = _attend_keys(q, q_pos, start, hi, m_i, l_i, acc, bt_row, k_cache_ptr, v_cache_ptr,
                                         kv_head, dims, dim_ok, scale_log2, window, stride_c_blk,
                                         stride_c_slot, stride_c_head, KV_BLOCK, BLOCK_N, DOT_PRECISION)
            start += BLOCK_N
    else:
        for start in range(lo, hi, BLOCK_N):
            m_i, l_i, acc = _attend_keys(q, q_pos, start, hi, m_i, l_i, acc, bt_row, k_cache_ptr, v_cache_ptr,
                                         kv_head, dims, dim_ok, scale_log2, window, stride_c_blk,
                                         stride_c_slot, stride_c_head, KV_BLOCK, BLOCK_N, DOT_PRECISION)
    mask = row_ok[:, None] & dim_ok[None, :]
    if SPLITS == 1:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + tok[:, None] * stride_o_tok + head[:, None] * stride_o_head + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # partial results [token, head, split] for _combine_splits_kernel
        part = (tok * (GROUP * tl.num_programs(1)) + head) * SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * BLOCK_D + dims[None, :], acc, mask=mask)
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _combine_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, num_heads, stride_o_tok, stride_o_head,
                           SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS)
    dims = tl.arange(0, BLOCK_D)
    base = (tok * num_heads + head) * SPLITS + splits
    m = tl.load(part_ml_ptr + base * 2)
    l = tl.load(part_ml_ptr + base * 2 + 1)
    acc = tl.load(part_acc_ptr + base[:, None] * BLOCK_D + dims[None, :])
    w = tl.exp2(m - tl.max(m, 0))
    total = tl.sum(w * l, 0)
    out = tl.sum(w[:, None] * acc, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + tok * stride_o_tok + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    tile_seq: torch.Tensor, tile_q0: torch.Tensor, query_start_loc: torch.Tensor,
                    seq_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, block_q: int,
                    block_m: int, splits: int = 1, window: int | None = None, pdl: bool = False) -> torch.Tensor:
    """Write attention of ``q`` [T, heads, D] over the paged cache into ``out`` [T, heads, D].

    k_cache/v_cache: [num_blocks, block_size, kv_heads, D] (any strides over
    the first three dims, contiguous D). ``tile_seq``/``tile_q0`` list the
    tiles built for ``block_q`` (see ``attention.metadata.tile_shape``).
    ``splits`` > 1 (decode tiles only, a power of two) divides each
    sequence's keys among that many programs and combines their partial
    softmaxes in a second kernel: a decode batch too small to fill the GPU
    with one program per (sequence, KV head) still reads its keys in parallel.
    ``window``: a sliding-window layer's width (None: the whole context). ``pdl``: both kernels launched
    with programmatic dependent launch (``kernels.pdl``).
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, kv_block = k_cache.shape[2], k_cache.shape[1]
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1 or q.stride(-1) != 1:
        raise ValueError("paged_attention needs K and V caches of equal strides and a contiguous head_dim")
    if splits > 1 and block_q != 1:
        raise ValueError("splitting the keys (splits > 1) is for decode tiles (block_q == 1)")
    block_d = triton.next_power_of_2(head_dim)
    tokens = q.shape[0]
    if splits > 1:
        part_acc = torch.empty((tokens, num_heads, splits, block_d), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((tokens, num_heads, splits, 2), dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    grid = (tile_seq.shape[0], kv_heads, splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, tile_seq, tile_q0, query_start_loc, seq_lens, block_tables,
        scale * _LOG2E, _NO_WINDOW if window is None else int(window),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // kv_heads, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_D=block_d, KV_BLOCK=kv_block,
        BLOCK_N=64,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        WHILE_LOOP=os.environ.get("TRITON_INTERPRET") == "1", SPLITS=splits, part_acc_ptr=part_acc,
        part_ml_ptr=part_ml, num_warps=4, num_stages=2, **pdl_args(pdl),
    )
    if splits > 1 and tokens:
        _combine_splits_kernel[(tokens, num_heads)](part_acc, part_ml, out, num_heads, out.stride(0), out.stride(1),
                                                    SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d, num_warps=1,
                                                    **pdl_args(pdl))
    return out
