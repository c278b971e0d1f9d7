"""Fused elementwise kernels of the decoder layer: add + RMSNorm, SiLU-and-multiply, RoPE + KV store.

Why hand-written: in eager torch each of these is 3-8 kernel launches and as
many round trips through memory; at decode batch sizes a layer's arithmetic
is tiny, so launches and memory passes are the cost. torch.compile would fuse
them too, but its caches are process-wide and outlive the engine (DESIGN.md);
Triton keeps only the compiled kernels per process, no tensors.

Each kernel rounds to the model dtype at the same points as the torch
reference path (``model/layers.py``), so both paths agree to the last bit in
most positions and within one bf16 ulp elsewhere.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _add_rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_cols, eps,
                         HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * n_cols + cols, x, mask=mask)
    h = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(h * h, 0) / n_cols + eps)
    normed = (h * rstd).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``(norm(x + residual) * weight, x + residual)`` for contiguous [T, hidden] inputs. ``pdl``: launched
    with programmatic dependent launch (``kernels.pdl``), as every kernel here may be."""
    rows, cols = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else x
    if rows:
        _add_rms_norm_kernel[(rows,)](x, residual if residual is not None else x, weight, out, res_out, cols, eps,
                                      HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(cols),
                                      num_warps=4 if cols <= 4096 else 8, **pdl_args(pdl))
    return out, res_out


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * 2 * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_up_ptr + row * 2 * n_cols + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` for a contiguous [T, 2 * I] tensor holding gate then up."""
    rows, width = gate_up.shape
    n = width // 2
    out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if rows:
        _silu_mul_kernel[(rows, triton.cdiv(n, block))](gate_up, out, n, BLOCK=block, num_warps=4,
                                                        **pdl_args(pdl))
    return out


@triton.jit
def _rope_store_kernel(qkv_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                       stride_tok, stride_cos, stride_c_blk, stride_c_slot, stride_c_head,
                       NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                       HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, KV_BLOCK: tl.constexpr, STORE: tl.constexpr,
                       PDL: tl.constexpr):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # 0..NUM_HEADS-1: query heads; then key heads
    pos = tl.load(pos_ptr + tok)
    dims = tl.arange(0, BLOCK_HALF)
    ok = dims < HALF
    dtype = qkv_ptr.dtype.element_ty
    # The reference path casts the float32 table to the model dtype before multiplying.
    cos = tl.load(cos_ptr + pos * stride_cos + dims, mask=ok, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(sin_ptr + pos * stride_cos + dims, mask=ok, other=0.0).to(dtype).to(tl.float32)
    base = qkv_ptr + tok * stride_tok + head * HEAD_DIM
    x1 = tl.load(base + dims, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + dims, mask=ok, other=0.0).to(tl.float32)
    # x * cos + rotate_half(x) * sin, each product and the sum rounded like torch does in the model dtype.
    y1 = ((x1 * cos).to(dtype).to(tl.float32) + (-x2 * sin).to(dtype).to(tl.float32)).to(dtype)
    y2 = ((x2 * cos).to(dtype).to(tl.float32) + (x1 * sin).to(dtype).to(tl.float32)).to(dtype)
    tl.store(base + dims, y1, mask=ok)
    tl.store(base + HALF + dims, y2, mask=ok)
    if STORE:
        if head >= NUM_HEADS:
            slot = tl.load(slot_ptr + tok)
            if slot >= 0:  # negative: a CUDA-graph padding row, nothing to store
                kv_head = head - NUM_HEADS
                dst = (slot // KV_BLOCK) * stride_c_blk + (slot % KV_BLOCK) * stride_c_slot + kv_head * stride_c_head
                tl.store(k_cache_ptr + dst + dims, y1, mask=ok)
                tl.store(k_cache_ptr + dst + HALF + dims, y2, mask=ok)
                v_src = qkv_ptr + tok * stride_tok + (NUM_HEADS + NUM_KV_HEADS + kv_head) * HEAD_DIM
                tl.store(v_cache_ptr + dst + dims, tl.load(v_src + dims, mask=ok), mask=ok)
                tl.store(v_cache_ptr + dst + HALF + dims, tl.load(v_src + HALF + dims, mask=ok), mask=ok)


def rope_and_store(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int, slot_mapping: torch.Tensor | None,
                   k_cache: torch.Tensor | None, v_cache: torch.Tensor | None, pdl: bool = False) -> None:
    """Rotate the query and key heads of ``qkv`` [T, (H + 2 KV) * D] in place and, given a
    slot mapping, write the rotated keys and the values into the paged cache
    ([num_blocks, block_size, kv_heads, D]; a negative slot is skipped).

    ``cos``/``sin``: float32 [max_positions, D] tables (halves duplicated, HF layout).
    """
    tokens = qkv.shape[0]
    if not tokens:
        return
    store = slot_mapping is not None
    strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)) if store else (0, 0, 0)
    _rope_store_kernel[(tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, positions, slot_mapping if store else positions,
        k_cache if store else qkv, v_cache if store else qkv,
        qkv.stride(0), cos.stride(0), *strides,
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=head_dim // 2,
        BLOCK_HALF=triton.next_power_of_2(head_dim // 2), KV_BLOCK=k_cache.shape[1] if store else 1,
        STORE=store, num_warps=1, **pdl_args(pdl),
    )


@triton.jit
def _take_pending_kernel(ids_ptr, pending_ptr, n, n_pending, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < n, other=0)
    take = (offs < n) & (ids < 0)
    row = tl.minimum(tl.maximum(-1 - ids, 0), n_pending - 1)
    tl.store(ids_ptr + offs, tl.load(pending_ptr + row, mask=take, other=0).to(ids.dtype), mask=take)


def take_pending(input_ids: torch.Tensor, pending: torch.Tensor, block: int = 1024) -> None:
    """Async scheduling's device-side inputs (``TorchOps.take_pending``): ids -1 - r become ``pending[r]``,
    in place (``input_ids`` contiguous)."""
    if input_ids.numel() and pending.numel():
        _take_pending_kernel[(triton.cdiv(input_ids.numel(), block),)](input_ids, pending, input_ids.numel(),
                                                                        pending.numel(), BLOCK=block)
