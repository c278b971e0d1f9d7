"""The experts of a mixture-of-experts layer as two grouped products: tokens sorted by expert, one kernel each.

Why hand-written: the torch path (``TorchOps.moe_experts``) runs one product
per expert that received tokens, and has to ask the host which ones did: a
synchronisation and 3 x E launches per layer, which also rules out CUDA graphs.
Here the routing is turned into a padded, expert-sorted list of (token, slot)
entries on the device, with shapes that depend only on the number of tokens,
and each product is one launch over all experts: a program takes ``BLOCK_M``
entries of one expert (blocks never mix experts), so it reads only that
expert's weights and experts nobody chose cost nothing.

1. ``align``: entries ``t * k + j`` grouped by expert, each group padded to a
   multiple of ``BLOCK_M`` with the sentinel ``T * k``; the expert of every block
   (one single-program launch for decode-sized batches, torch's sort beyond).
2. ``gate_up = x[token] @ w13[e]^T`` for every entry, then SiLU-and-multiply
   (``fused.silu_mul``).
3. ``y = weight * (act @ w2[e]^T)`` per entry; the ``k`` entries of a token are summed.

Rounding follows the reference except that the routing weight multiplies the
float32 accumulator of the down product, before its single rounding to the
model dtype (the reference rounds the product first).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from . import fused

# Up to this many entries (tokens x k) the alignment is one single-program kernel (decode and CUDA-graph
# batch sizes, where its ~20 torch launches would cost more than the products); beyond, torch's sort.
ALIGN_IN_ONE_KERNEL = 4096


class TileConfig(NamedTuple):
    block_m: int  # entries per program (all of one expert)
    block_n: int
    block_k: int
    warps: int
    stages: int


@triton.jit
def _grouped_kernel(a_ptr, b_ptr, c_ptr, w_ptr, sorted_ptr, expert_ptr, n_entries, n_out, n_in, num_experts,
                    stride_am, stride_be, stride_bn, stride_cm,
                    ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """``c[entry] = (w[entry] *) a[entry // ROW_DIV] @ b[e]^T`` for the BLOCK_M entries of block ``program_id(0)``,
    all of expert ``e``, over output columns ``program_id(1) * BLOCK_N``..; b is [E, n_out, n_in], rows contiguous."""
    block = tl.program_id(0)
    e = tl.load(expert_ptr + block)
    if e >= num_experts:  # past the last expert's entries
        return
    entries = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = entries < n_entries
    rows = (entries // ROW_DIV).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
    b_ptrs = b_ptr + e.to(tl.int64) * stride_be + cols[None, :].to(tl.int64) * stride_bn + ks[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k_ok = ks < n_in - k0
        a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(cols[None, :] < n_out) & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if MUL_WEIGHT:
        acc = acc * tl.load(w_ptr + entries, mask=valid, other=0.0)[:, None]
    c_ptrs = c_ptr + entries[:, None].to(tl.int64) * stride_cm + cols[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < n_out))


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, n, num_experts, size, num_blocks,
                  E_P: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """``align`` in one program: count, pad, scatter in token order, name each block's expert."""
    experts = tl.arange(0, E_P)
    counts = tl.zeros((E_P,), dtype=tl.int32)
    for c in range(0, n, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        e = tl.load(ids_ptr + offs, mask=offs < n, other=E_P).to(tl.int32)
        counts += tl.sum((e[:, None] == experts[None, :]).to(tl.int32), axis=0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    for c in range(0, size, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        tl.store(sorted_ptr + offs, tl.zeros((CHUNK,), dtype=tl.int32) + n, mask=offs < size)
    tl.debug_barrier()  # the padding is written before any entry lands on it
    start = ends - padded
    for c in range(0, n, CHUNK):
        offs = c + tl.arange(0, CHUNK)
        ok = offs < n
        e = tl.load(ids_ptr + offs, mask=ok, other=E_P).to(tl.int32)
        onehot = (e[:, None] == experts[None, :]).to(tl.int32)
        rank = tl.sum((tl.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # earlier entries of its expert here
        base = tl.sum(onehot * start[None, :], axis=1)
        tl.store(sorted_ptr + base + rank, offs, mask=ok)
        start += tl.sum(onehot, axis=0)
    block_ends = ends // BLOCK_M
    for c in range(0, num_blocks, CHUNK):
        b = c + tl.arange(0, CHUNK)
        owner = tl.sum(((block_ends[None, :] <= b[:, None]) & (experts[None, :] < num_experts)).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, owner, mask=b < num_blocks)


def aligned_size(n: int, num_experts: int, block_m: int) -> int:
    """Entries after padding, at most: every chosen expert's group padded up to a multiple of ``block_m``."""
    return triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m) * block_m


def align_one_kernel(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``align`` as one launch (equal to it, entry for entry)."""
    n = ids.numel()
    size = aligned_size(n, num_experts, block_m)
    sorted_entries = torch.empty(size, dtype=torch.int32, device=ids.device)
    block_expert = torch.empty(size // block_m, dtype=torch.int32, device=ids.device)
    e_p = triton.next_power_of_2(num_experts + 1)
    _align_kernel[(1,)](ids.reshape(-1), sorted_entries, block_expert, n, num_experts, size, size // block_m,
                        E_P=e_p, BLOCK_M=block_m, CHUNK=max(16, min(1024, 8192 // e_p)), num_warps=4)
    return sorted_entries, block_expert


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted entries int32 [P], expert of each block int32 [P / block_m]) for routing ``ids`` [T, k].

    Entries are grouped by expert (in token order inside a group), each group padded with ``T * k`` to a
    multiple of ``block_m``; blocks past the last group get expert ``num_experts``. ``P`` is the bound
    ``T * k + min(E, T * k) * (block_m - 1)`` rounded up, so no host read of the counts is needed (CUDA
    graphs capture this as it is).
    """
    n = ids.numel()
    flat = ids.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = padded.cumsum(0)
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    first = (counts.cumsum(0) - counts)[expert_of]  # where each expert's entries start in ``order``
    dest = (ends - padded)[expert_of] + torch.arange(n, device=ids.device) - first
    size = aligned_size(n, num_experts, block_m)
    sorted_entries = torch.full((size,), n, dtype=torch.int32, device=ids.device)
    sorted_entries[dest] = order.to(torch.int32)
    blocks = torch.arange(size // block_m, device=ids.device)
    block_expert = torch.searchsorted(ends // block_m, blocks, right=True).to(torch.int32)
    return sorted_entries, block_expert


def _grouped(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
             sorted_entries: torch.Tensor, block_expert: torch.Tensor, row_div: int, cfg: TileConfig) -> None:
    n_out, n_in = b.shape[1], b.shape[2]
    block_n = min(cfg.block_n, max(16, triton.next_power_of_2(n_out)))
    block_k = min(cfg.block_k, max(16, triton.next_power_of_2(n_in)))
    grid = (block_expert.numel(), triton.cdiv(n_out, block_n))
    _grouped_kernel[grid](a, b, out, weights if weights is not None else out, sorted_entries, block_expert,
                          out.shape[0], n_out, n_in, b.shape[0], a.stride(0), b.stride(0), b.stride(1), out.stride(0),
                          ROW_DIV=row_div, MUL_WEIGHT=weights is not None,
                          DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
                          BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=cfg.warps,
                          num_stages=cfg.stages)


def tile_config(entries: int, num_experts: int) -> TileConfig:
    """Tiles by how many entries an expert gets on average: 16 rows (tl.dot's least) and long k-steps while
    they are few (decode: the weights stream, little arithmetic), larger tiles as they grow (prefill: each
    expert's weights are reread once per row block). Chosen from a sweep of 13 configs on the H200 over
    OLMoE, Qwen3-30B-A3B and Mixtral expert shapes at 1-2048 tokens (docs/BENCHMARKS.md)."""
    per_expert = entries / num_experts
    if per_expert <= 8:
        return TileConfig(16, 64, 128, 4, 4)
    if per_expert <= 32:
        return TileConfig(32, 64, 128, 4, 3)
    if per_expert <= 96:
        return TileConfig(64, 128, 64, 4, 4)
    return TileConfig(128, 128, 64, 8, 3)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                ids: torch.Tensor, cfg: TileConfig | None = None) -> torch.Tensor:
    """``sum_j weights[t, j] * expert_ids[t, j](x[t])`` (see ``TorchOps.moe_experts``) in two grouped launches."""
    tokens, top_k = ids.shape
    n, num_experts = tokens * top_k, w13.shape[0]
    if n == 0:
        return torch.zeros_like(x)
    cfg = cfg or tile_config(n, num_experts)
    sort = align_one_kernel if n <= ALIGN_IN_ONE_KERNEL else align
    sorted_entries, block_expert = sort(ids, num_experts, cfg.block_m)
    gate_up = torch.empty((n, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped(x, w13, gate_up, None, sorted_entries, block_expert, top_k, cfg)
    act = fused.silu_mul(gate_up)
    down = torch.empty((n, w2.shape[1]), dtype=x.dtype, device=x.device)
    _grouped(act, w2, down, weights.reshape(-1).float().contiguous(), sorted_entries, block_expert, 1, cfg)
    return down.view(tokens, top_k, -1).sum(dim=1)
