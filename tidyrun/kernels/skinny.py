"""Kernels for the few-row case of decoding: ``x W^T`` with at most 16 rows, and a row-wise argmax.

Why hand-written: at batch 1-16 a decode step is a string of matrix-vector
products whose cost is reading the weights once. cuBLAS picks tiles of 64
output features with no split of the reduction for the 2048-wide projections
of a 1B model, so only 32-48 of the H200's 132 SMs read weights and those
run at ~1.8 TB/s of its ~4.3. Here the launch is sized to the machine: narrow
output tiles and, where the grid is still small, a split of the reduction
whose partial sums are added in a fixed order by a second kernel (no atomics,
so every run gives the same bits). torch's argmax over a 128k vocabulary row
is one block's reduction (~28 us); two passes over 4096-wide slices take a
few microseconds.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x one launch covers: the smallest tensor-core tile


class SkinnyConfig(NamedTuple):
    """Tile of one launch: output features per program, reduction step, reduction split, pipeline depth."""
    block_n: int
    block_k: int
    split_k: int
    stages: int


@triton.jit
def _skinny_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_x, K_PER_SPLIT: tl.constexpr,
                          HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # a compile-time trip count: one variant per layer shape
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=(rn[None, :] < N) & (rk[:, None] < K),
                    other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # float32 partial sums [SPLIT, M, N]
        tl.store(out_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr,
                       BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # fixed order: the same bits on every run
        acc += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M <= 16, K] (last dim contiguous) and a contiguous weight [N, K].

    (Fusing the MLP's SiLU-mul into this kernel's loads was tried: 2-5x slower
    than the two kernels on the H200, so the activation stays separate.)
    """
    rows = x.shape[0]
    n, k = weight.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    dest = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, cfg.block_n), split)
    _skinny_matmul_kernel[grid](x, weight, bias if bias is not None else weight, dest, rows, n, k, x.stride(0),
                                K_PER_SPLIT=k_per_split, HAS_BIAS=bias is not None and split == 1, BLOCK_M=MAX_ROWS,
                                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split, num_warps=4,
                                DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                                num_stages=cfg.stages)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(rows, triton.cdiv(n, block))](dest, bias if bias is not None else weight, out, rows, n,
                                                          HAS_BIAS=bias is not None, SPLIT=split, BLOCK=block)
    return out


def skinny_config(n: int, k: int, num_sms: int) -> SkinnyConfig | None:
    """The tile for a weight [n, k], or None where cuBLAS is as fast.

    Measured on the H200 with weights not in L2 (docs/BENCHMARKS.md): cuBLAS
    streams wide projections (gate/up, QKV, the LM head) at 3.3-4.2 TB/s, but
    for outputs no wider than the reduction (o_proj, down_proj) it launches too
    few programs or splits with a separate reduce. Per product at one row,
    cuBLAS vs this tile: 8B o_proj 13.7 vs 10.8 us, 8B down_proj 32.1 vs 29.9,
    1.2B down_proj 13.7 vs 13.0, 1.2B o_proj 6.0 vs 5.9. Those shapes get
    32-wide output tiles; a reduction at least twice the outputs is split until
    about half the SMs have two programs.
    """
    if n > 4096 or k < n:
        return None
    programs, split = triton.cdiv(n, 32), 1
    while k >= 2 * n and programs * split * 2 <= num_sms and k // (split * 2) >= 1024:
        split *= 2
    return SkinnyConfig(block_n=32, block_k=512 if split == 1 else 256, split_k=split, stages=4)


@triton.jit
def _argmax_slices_kernel(x_ptr, val_ptr, idx_ptr, V, stride_x, SLICES, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * SLICES + part, best)
    tl.store(idx_ptr + row * SLICES + part, part * BLOCK + at)


@triton.jit
def _argmax_final_kernel(val_ptr, idx_ptr, out_ptr, SLICES, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK)
    vals = tl.load(val_ptr + row * SLICES + parts, mask=parts < SLICES, other=-float("inf"))
    idx = tl.load(idx_ptr + row * SLICES + parts, mask=parts < SLICES, other=0)
    _, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(parts == at, idx, 0), axis=0).to(tl.int64))


def argmax_rows(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Index of each row's largest value (the first one on ties, like torch.argmax) for x [M, V]; int64 [M].

    Rows must be free of NaN (logits are).
    """
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows == 0:
        return out
    slices = triton.cdiv(vocab, block)
    vals = torch.empty(rows, slices, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, slices, dtype=torch.int32, device=x.device)
    _argmax_slices_kernel[(rows, slices)](x, vals, idx, vocab, x.stride(0), slices, BLOCK=block, num_warps=8)
    _argmax_final_kernel[(rows,)](vals, idx, out, slices, BLOCK=max(16, triton.next_power_of_2(slices)))
    return out
