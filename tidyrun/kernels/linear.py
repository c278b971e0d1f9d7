"""``x W^T (+ b)`` for any number of rows, with a reduction order that depends on the weight alone.

Why hand-written, twice over. Speed: at batch 1-16 a decode step is a
string of matrix-vector products whose cost is reading the weights once;
cuBLAS picks tiles of 64 output features with no split of the reduction for
the 2048-wide projections of a 1B model, so only 32-48 of the H200's 132 SMs
read weights, at ~1.8 TB/s of its ~4.3. Here a few-row launch is sized to
the machine: narrow output tiles and, where the grid is still small, a split
of the reduction. The MLP's gate/up product can end with the SiLU-mul, one
kernel and one round trip through memory fewer per layer. Invariance: cuBLAS
picks its algorithm (tile, split of the reduction, order of partial sums)
from the number of rows, so a row's result can depend on how many rows
share the step. Here the K axis is cut into segments of ``k_seg`` features
(a property of the weight, a multiple of every ``BLOCK_K`` used); each
segment is accumulated from zero by ``tl.dot`` and the segments are added in
order. A few-row launch runs each segment in its own program (the last one
of a tile to finish adds the partials, or a second kernel when no arrival
counters are at hand); a many-row launch runs them one after the other in
one program (on Hopper and later taking its tiles by tensor descriptors:
5-27% faster per product at 256-4096 rows on the H100, the same bits).
Measured on the H200 (bf16): tiles of 16-128 rows, 32-256 output features,
``BLOCK_K`` 64-256, 4 or 8 warps, and the split or serial launch give every
row the same bits; cuBLAS and a different ``k_seg`` do not.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue

try:  # host-side tensor descriptors (the many-row launch's tiles by Hopper's copy engine): Triton 3.3 and later
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:
    TensorDescriptor = None

FEW_ROWS = 16  # up to this many rows a product is split over programs by segment (the smallest dot tile)
MANY_ROW_BLOCK_K = 64  # the many-row launch's reduction step; every plan's k_seg is a multiple of it


class LinearPlan(NamedTuple):
    """A weight's reduction order (``k_seg``) and its few-row launch (``block_n``, ``block_k``, ``stages``)."""
    block_n: int
    block_k: int
    k_seg: int
    stages: int


class ManyRowTile(NamedTuple):
    """The tile of a many-row launch: it changes the speed, never the bits."""
    block_m: int
    block_n: int
    warps: int
    stages: int


@triton.jit
def _segment(x_ptr, w_ptr, rm, rn, k_lo, M, N, K, stride_x, K_SEG: tl.constexpr, GATED: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """The partial sums of features [k_lo, k_lo + K_SEG), accumulated from zero in BLOCK_K steps."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED: the up half, rows N..2N of the weight
    for k0 in range(0, K_SEG, BLOCK_K):  # a compile-time trip count
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        w_mask = (rn[None, :] < N) & (rk[:, None] < K)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptr + (rn[None, :] + N).to(tl.int64) * K + rk[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    return acc, acc_up


@triton.jit
def _epilogue(acc, acc_up, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS: tl.constexpr, GATED: tl.constexpr):
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    dtype = out_ptr.dtype.element_ty
    offs = rm[:, None].to(tl.int64) * N + rn[None, :]
    if GATED:  # silu(gate) * up, rounded where the unfused path (product, then silu_mul) rounds
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + offs, (act * acc_up.to(dtype).to(tl.float32)).to(dtype), mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, acc.to(dtype), mask=mask)


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_x,
                   K_SEG: tl.constexpr, SEGMENTS: tl.constexpr, SPLIT_GRID: tl.constexpr,
                   HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, FINISH_IN_KERNEL: tl.constexpr, DOT_PRECISION: tl.constexpr,
                   PDL: tl.constexpr):
    pdl_prologue(PDL)
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pid_n = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if not SPLIT_GRID:  # every segment here, added in order
        total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for s in range(SEGMENTS):
            acc, acc_up = _segment(x_ptr, w_ptr, rm, rn, s * K_SEG, M, N, K, stride_x, K_SEG, GATED,
                                   BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
            total += acc
            total_up += acc_up
        _epilogue(total, total_up, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS, GATED)
    else:  # one segment per program (one row tile): float32 partial sums [SEGMENTS, M, N]
        seg = tl.program_id(2)
        acc, acc_up = _segment(x_ptr, w_ptr, rm, rn, seg * K_SEG, M, N, K, stride_x, K_SEG, False,
                               BLOCK_M, BLOCK_N, BLOCK_K, DOT_PRECISION)
        mask = (rm[:, None] < M) & (rn[None, :] < N)
        tl.store(part_ptr + (seg * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
        if FINISH_IN_KERNEL:
            # The last program of this output tile to arrive adds the partials, in segment order, and
            # re-arms the counter. The barrier puts every warp's stores before the release of the counter
            # update; the acquire puts the other programs' stores before the loads below, which bypass L1.
            tl.debug_barrier()
            counter = count_ptr + tl.program_id(0) * tl.num_programs(1) + pid_n  # one per output tile
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == SEGMENTS - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SEGMENTS):
                    total += tl.load(part_ptr + (s * M + rm[:, None]) * N + rn[None, :], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                _epilogue(total, total, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS, False)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _linear_tma_kernel(x_desc, w_desc, b_ptr, out_ptr, M, N, K_SEG: tl.constexpr, SEGMENTS: tl.constexpr,
                       HAS_BIAS: tl.constexpr, GATED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       PDL: tl.constexpr):
    """The many-row launch with its tiles brought in by tensor descriptors (Hopper's copy engine: no address
    arithmetic or masks per element, zeros past every edge) and output tiles walked in groups of ``GROUP_M``
    row tiles (weight tiles reused from L2). The same segments, steps and order as ``_linear_kernel``'s
    serial path, so the same bits. Past an edge the gate half reads up rows: those columns are never stored."""
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m
    off_m, off_n = pid_m * BLOCK_M, pid_n * BLOCK_N
    total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    total_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SEGMENTS):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K_SEG, BLOCK_K):
            k = s * K_SEG + k0
            x = x_desc.load([off_m, k])
            acc = tl.dot(x, w_desc.load([off_n, k]).T, acc, input_precision=DOT_PRECISION)
            if GATED:
                acc_up = tl.dot(x, w_desc.load([N + off_n, k]).T, acc_up, input_precision=DOT_PRECISION)
        total += acc
        total_up += acc_up
    rm = off_m + tl.arange(0, BLOCK_M)
    rn = off_n + tl.arange(0, BLOCK_N)
    _epilogue(total, total_up, b_ptr, out_ptr, rm, rn, M, N, HAS_BIAS, GATED)


@triton.jit
def _sum_segments_kernel(part_ptr, b_ptr, out_ptr, M, N, HAS_BIAS: tl.constexpr, SEGMENTS: tl.constexpr,
                         BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SEGMENTS):  # segment order: the bits of the in-kernel finish
        total += tl.load(part_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        total += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + cols, total.to(out_ptr.dtype.element_ty), mask=mask)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, plan: LinearPlan,
           counters: torch.Tensor | None = None, gated: bool = False, tile: ManyRowTile | None = None,
           split_grid: bool | None = None, pdl: bool = False, tma: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M, K] (last dim contiguous) and a contiguous weight [N, K].

    ``gated``: the weight is [2I, K], gate rows then up rows, and the result is
    ``silu(x @ gate.T) * (x @ up.T)`` [M, I], the MLP's activation in the
    product's epilogue (no bias, and a plan of one segment).

    ``counters``: a zeroed int32 buffer with an entry per output tile (16 rows
    by ``block_n`` features); given enough, a few-row split is finished by its
    last program instead of a second kernel (one launch fewer, the same bits).
    The kernel leaves it zeroed. ``tile``: the many-row launch's tile (default
    ``many_row_tile``). ``split_grid``: force the few-row launch (True; more
    than 16 rows run as blocks of 16, each the program a lone row gets) or the
    many-row one (False). ``pdl``: launch with programmatic dependent launch
    (``kernels.pdl``; Hopper and later). ``tma``: the GPU takes tensor
    descriptors (Hopper and later; the caller knows its device, as for
    ``pdl``): the many-row launch then takes its tiles by them
    (``_linear_tma_kernel``, the same bits) where ``rows_aligned`` allows.
    """
    rows = x.shape[0]
    n, k = weight.shape
    segments = triton.cdiv(k, plan.k_seg)
    if gated:
        if bias is not None or segments != 1:
            raise ValueError("a gated product takes no bias and a plan of one segment")
        n //= 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    b = bias if bias is not None else weight  # any pointer: HAS_BIAS=False never reads it
    dot = "ieee" if x.dtype == torch.float32 else "tf32"
    few = rows <= FEW_ROWS if split_grid is None else split_grid
    if plan.k_seg % plan.block_k or plan.k_seg % MANY_ROW_BLOCK_K:
        raise ValueError(f"{plan}: k_seg must be a multiple of block_k and of {MANY_ROW_BLOCK_K}")
    if not few or segments == 1:
        if few:
            block_m, block_n, warps, stages, block_k = FEW_ROWS, plan.block_n, 4, plan.stages, plan.block_k
        else:
            block_m, block_n, warps, stages = tile or many_row_tile(rows, gated)
            block_k = MANY_ROW_BLOCK_K
            if tma and TensorDescriptor is not None and rows_aligned(x, weight):
                grid = (triton.cdiv(rows, block_m) * triton.cdiv(n, block_n),)
                _linear_tma_kernel[grid](
                    TensorDescriptor.from_tensor(x, [block_m, block_k]),
                    TensorDescriptor.from_tensor(weight, [block_n, block_k]), b, out, rows, n, K_SEG=plan.k_seg,
                    SEGMENTS=segments, HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=block_m, BLOCK_N=block_n,
                    BLOCK_K=block_k, GROUP_M=8, DOT_PRECISION=dot, num_warps=warps, num_stages=stages,
                    **pdl_args(pdl))
                return out
        grid = (triton.cdiv(rows, block_m), triton.cdiv(n, block_n), 1)
        _linear_kernel[grid](x, weight, b, out, out, out, rows, n, k, x.stride(0), K_SEG=plan.k_seg,
                             SEGMENTS=segments, SPLIT_GRID=False, HAS_BIAS=bias is not None, GATED=gated,
                             BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, FINISH_IN_KERNEL=False,
                             DOT_PRECISION=dot, num_warps=warps, num_stages=stages, **pdl_args(pdl))
        return out
    row_blocks, tiles = triton.cdiv(rows, FEW_ROWS), triton.cdiv(n, plan.block_n)
    finish = counters is not None and counters.numel() >= row_blocks * tiles
    part = torch.empty(segments, rows, n, dtype=torch.float32, device=x.device)
    _linear_kernel[(row_blocks, tiles, segments)](
        x, weight, b, out, part, counters if finish else out, rows, n, k, x.stride(0), K_SEG=plan.k_seg,
        SEGMENTS=segments, SPLIT_GRID=True, HAS_BIAS=bias is not None, GATED=False, BLOCK_M=FEW_ROWS,
        BLOCK_N=plan.block_n, BLOCK_K=plan.block_k, FINISH_IN_KERNEL=finish, DOT_PRECISION=dot, num_warps=4,
        num_stages=plan.stages, **pdl_args(pdl))
    if not finish:
        block = 1024
        _sum_segments_kernel[(rows, triton.cdiv(n, block))](part, b, out, rows, n, HAS_BIAS=bias is not None,
                                                            SEGMENTS=segments, BLOCK=block, **pdl_args(pdl))
    return out


def rows_aligned(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether rows and their starts lie at multiples of 16 bytes, the copy engine's rule for a tensor
    descriptor."""
    size = x.element_size()
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * size % 16 == 0 and t.stride(1) == 1 for t in (x, weight))


def narrow_plan(n: int, k: int, num_sms: int) -> LinearPlan | None:
    """The plan of a weight [n, k] whose few-row product beats cuBLAS, or None where cuBLAS is as fast.

    Measured on the H200 with weights not in L2 (docs/BENCHMARKS.md): cuBLAS
    streams wide projections (gate/up, QKV, the LM head) at 3.3-4.2 TB/s, but
    for outputs no wider than the reduction (o_proj, down_proj) it launches too
    few programs or splits with a separate reduce. Per product at one row,
    cuBLAS vs this tile: 8B o_proj 13.7 vs 10.8 us, 8B down_proj 31.4 vs 29.6,
    1.2B down_proj 13.3 vs 12.0 (split 4, finished in-kernel), 1.2B o_proj
    6.0 vs 5.9, 135M down_proj 5.1 vs 4.1 (split 8). Those shapes get 32-wide
    output tiles; where that leaves half the SMs idle, a reduction at least
    twice the outputs is split until there are about two programs per SM.
    """
    if n > 4096 or k < n:
        return None
    programs, split = triton.cdiv(n, 32), 1
    if 2 * programs <= num_sms:
        while k >= 2 * n and programs * split * 2 <= 2 * num_sms and k // (split * 2) >= 128:
            split *= 2
    block_k = 512 if split == 1 else (256 if k // split >= 1024 else 128)
    return LinearPlan(block_n=32, block_k=block_k, k_seg=_round_up(-(-k // split), block_k), stages=4)


def gated_plan(n: int, k: int, num_sms: int) -> LinearPlan:
    """The plan of the MLP's gate/up product with its SiLU-mul epilogue, for a weight [n = 2I, k].

    Each program reads a gate tile and the matching up tile; output tiles
    are 64 wide where that still gives every SM a program, else 32. Against
    cuBLAS's product plus the separate SiLU-mul kernel, at one row on the
    H200 (weights from HBM): 1.2B 18.0 vs 19.9 us, 8B 58.3 vs 61.6 us,
    135M 4.2 vs 5.5 us.
    """
    block_n = 64 if triton.cdiv(n // 2, 64) >= num_sms else 32
    return LinearPlan(block_n=block_n, block_k=128, k_seg=_round_up(k, 128), stages=3 if k >= 4096 else 4)


def wide_plan(n: int, k: int, num_sms: int) -> LinearPlan:
    """The plan of a weight that ``narrow_plan`` leaves to cuBLAS (QKV, the LM head), used where every
    product must be batch-invariant: one segment, 64-wide output tiles where that fills the SMs."""
    block_n = 64 if triton.cdiv(n, 64) >= num_sms else 32
    return LinearPlan(block_n=block_n, block_k=128, k_seg=_round_up(k, 128), stages=4)


def many_row_tile(rows: int, gated: bool) -> ManyRowTile:
    """The tile of a many-row launch (H200, 1.2B shapes: the fastest of six at 64 and 1024-4096 rows)."""
    if rows <= 64:
        return ManyRowTile(64, 128 if gated else 64, 4, 4)
    return ManyRowTile(128, 128, 8, 3)


def _round_up(x: int, step: int) -> int:
    return -(-x // step) * step
