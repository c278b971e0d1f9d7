"""Kernels for the few-row case of decoding: ``x W^T`` with at most 16 rows, and a row-wise argmax.

Why hand-written: at batch 1-16 a decode step is a string of matrix-vector
products whose cost is reading the weights once. cuBLAS picks tiles of 64
output features with no split of the reduction for the 2048-wide projections
of a 1B model, so only 32-48 of the H200's 132 SMs read weights and those
run at ~1.8 TB/s of its ~4.3. Here the launch is sized to the machine: narrow
output tiles and, where the grid is still small, a split of the reduction
whose partial sums are added in a fixed order (so every run gives the same
bits) by the last program of each tile to finish, or by a second kernel when
no arrival counters are at hand. The MLP's gate/up product can end with the
SiLU-mul, one kernel and one round trip through memory fewer per layer.
torch's argmax over a 128k vocabulary row is one block's reduction (~28 us);
two passes over 4096-wide slices take a few microseconds.
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
def _skinny_matmul_kernel(x_ptr, w_ptr, b_ptr, out_ptr, part_ptr, count_ptr, M, N, K, stride_x,
                          K_PER_SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, GATED: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                          FINISH_IN_KERNEL: tl.constexpr, DOT_PRECISION: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = pid_k * K_PER_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # GATED: the up half, rows N..2N of the weight
    for k0 in range(0, K_PER_SPLIT, BLOCK_K):  # a compile-time trip count: one variant per layer shape
        rk = k_lo + k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                    other=0.0)
        w_mask = (rn[None, :] < N) & (rk[:, None] < K)
        w = tl.load(w_ptr + rn[None, :].to(tl.int64) * K + rk[:, None], mask=w_mask, other=0.0)
        acc = tl.dot(x, w, acc, input_precision=DOT_PRECISION)
        if GATED:
            w_up = tl.load(w_ptr + (rn[None, :] + N).to(tl.int64) * K + rk[:, None], mask=w_mask, other=0.0)
            acc_up = tl.dot(x, w_up, acc_up, input_precision=DOT_PRECISION)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    dtype = out_ptr.dtype.element_ty
    if GATED:  # silu(gate) * up, rounded where the unfused path (product, then silu_mul) rounds
        gate = acc.to(dtype).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], (act * acc_up.to(dtype).to(tl.float32)).to(dtype),
                 mask=mask)
    elif SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * N + rn[None, :], acc.to(dtype), mask=mask)
    else:  # float32 partial sums [SPLIT, M, N]
        tl.store(part_ptr + (pid_k * M + rm[:, None]) * N + rn[None, :], acc, mask=mask)
        if FINISH_IN_KERNEL:
            # The last program of this output tile to arrive adds the partials, in split order (the same
            # bits on every run), and re-arms the counter. The barrier puts every warp's stores before
            # the release of the counter update; the acquire puts the other programs' stores before
            # the loads below, which bypass L1 (.cg).
            tl.debug_barrier()
            arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for s in tl.static_range(SPLIT):
                    total += tl.load(part_ptr + (s * M + rm[:, None]) * N + rn[None, :], mask=mask, other=0.0,
                                     cache_modifier=".cg")
                if HAS_BIAS:
                    total += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
                tl.store(out_ptr + rm[:, None] * N + rn[None, :], total.to(dtype), mask=mask)
                tl.atomic_xchg(count_ptr + pid_n, 0, sem="relaxed", scope="gpu")


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


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cfg: SkinnyConfig,
                  counters: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for x [M <= 16, K] (last dim contiguous) and a contiguous weight [N, K].

    ``gated``: the weight is [2I, K], gate rows then up rows, and the result is
    ``silu(x @ gate.T) * (x @ up.T)`` [M, I], the MLP's activation in the
    product's epilogue (no split, no bias). Fusing it into the *next*
    product's loads instead was tried: 2-5x slower, each program redid the
    activation of its whole input slice.

    ``counters``: a zeroed int32 buffer with an entry per output tile; given
    one, a split reduction is finished by its last program instead of a
    second kernel (one launch fewer, the same bits). The kernel leaves it zeroed.
    """
    rows = x.shape[0]
    n, k = weight.shape
    if gated:
        if bias is not None or cfg.split_k != 1:
            raise ValueError("a gated skinny product takes no bias and no split of the reduction")
        n //= 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_per_split)
    tiles = triton.cdiv(n, cfg.block_n)
    finish = split > 1 and counters is not None and counters.numel() >= tiles
    part = out if split == 1 else torch.empty(split, rows, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else weight  # any pointer: HAS_BIAS=False never reads it
    _skinny_matmul_kernel[(tiles, split)](
        x, weight, b, out, part, counters if finish else out, rows, n, k,
        x.stride(0), K_PER_SPLIT=k_per_split, HAS_BIAS=bias is not None, GATED=gated, BLOCK_M=MAX_ROWS,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT=split, FINISH_IN_KERNEL=finish,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4, num_stages=cfg.stages)
    if split > 1 and not finish:
        block = 1024
        _sum_splits_kernel[(rows, triton.cdiv(n, block))](part, b, out, rows, n, HAS_BIAS=bias is not None,
                                                          SPLIT=split, BLOCK=block)
    return out


def skinny_config(n: int, k: int, num_sms: int) -> SkinnyConfig | None:
    """The tile for a weight [n, k], or None where cuBLAS is as fast.

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
    k_per_split = k // split
    return SkinnyConfig(block_n=32, block_k=512 if split == 1 else (256 if k_per_split >= 1024 else 128),
                        split_k=split, stages=4)


def gated_config(n: int, k: int, num_sms: int) -> SkinnyConfig:
    """The tile of the MLP's gate/up product with its SiLU-mul epilogue, for a weight [n = 2I, k].

    Each program reads a gate tile and the matching up tile; output tiles
    are 64 wide where that still gives every SM a program, else 32. Against
    cuBLAS's product plus the separate SiLU-mul kernel, at one row on the
    H200 (weights from HBM): 1.2B 18.0 vs 19.9 us, 8B 58.3 vs 61.6 us,
    135M 4.2 vs 5.5 us.
    """
    block_n = 64 if triton.cdiv(n // 2, 64) >= num_sms else 32
    return SkinnyConfig(block_n=block_n, block_k=128, split_k=1, stages=3 if k >= 4096 else 4)


@triton.jit
def _argmax_slices_kernel(x_ptr, val_ptr, idx_ptr, sum_ptr, V, stride_x, SLICES, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * SLICES + part, best)
    tl.store(idx_ptr + row * SLICES + part, part * BLOCK + at)
    tl.store(sum_ptr + row * SLICES + part, tl.sum(tl.exp(x - best), axis=0))


@triton.jit
def _argmax_final_kernel(val_ptr, idx_ptr, sum_ptr, out_ptr, lp_ptr, SLICES, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK)
    vals = tl.load(val_ptr + row * SLICES + parts, mask=parts < SLICES, other=-float("inf"))
    idx = tl.load(idx_ptr + row * SLICES + parts, mask=parts < SLICES, other=0)
    sums = tl.load(sum_ptr + row * SLICES + parts, mask=parts < SLICES, other=0.0)
    best, at = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(out_ptr + row, tl.sum(tl.where(parts == at, idx, 0), axis=0).to(tl.int64))
    # log-probability of the argmax: max - logsumexp, the slices' sums rescaled to the row's max
    total = tl.sum(tl.where(parts < SLICES, sums * tl.exp(vals - best), 0.0), axis=0)
    tl.store(lp_ptr + row, -tl.log(total))


def argmax_logprob_rows(x: torch.Tensor, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of each row's largest value (the first one on ties, like torch.argmax) for x [M, V], int64 [M],
    and its log-probability under softmax(x), float32 [M]: one pass over the logits gives both, so a greedy
    step's logprobs cost nothing beyond its argmax (and are captured with it in the decode graphs).

    Rows must be free of NaN (logits are).
    """
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    logprob = torch.empty(rows, dtype=torch.float32, device=x.device)
    if rows == 0:
        return out, logprob
    slices = triton.cdiv(vocab, block)
    vals = torch.empty(rows, slices, dtype=torch.float32, device=x.device)
    idx = torch.empty(rows, slices, dtype=torch.int32, device=x.device)
    sums = torch.empty(rows, slices, dtype=torch.float32, device=x.device)
    _argmax_slices_kernel[(rows, slices)](x, vals, idx, sums, vocab, x.stride(0), slices, BLOCK=block, num_warps=8)
    _argmax_final_kernel[(rows,)](vals, idx, sums, out, logprob, slices, BLOCK=max(16, triton.next_power_of_2(slices)))
    return out, logprob


def argmax_rows(x: torch.Tensor, block: int = 4096) -> torch.Tensor:
    """Index of each row's largest value, int64 [M] (see ``argmax_logprob_rows``)."""
    return argmax_logprob_rows(x, block)[0]
