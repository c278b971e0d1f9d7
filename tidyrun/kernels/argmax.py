"""A row-wise argmax (and the argmax's log-probability) over the vocabulary.

Why hand-written: torch's argmax over a 128k vocabulary row is one block's
reduction (~28 us); two passes over 4096-wide slices take a few microseconds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .pdl import pdl_args, pdl_prologue


@triton.jit
def _argmax_slices_kernel(x_ptr, val_ptr, idx_ptr, sum_ptr, V, stride_x, SLICES, BLOCK: tl.constexpr,
                          PDL: tl.constexpr):
    pdl_prologue(PDL)
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
    best, at = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(val_ptr + row * SLICES + part, best)
    tl.store(idx_ptr + row * SLICES + part, part * BLOCK + at)
    tl.store(sum_ptr + row * SLICES + part, tl.sum(tl.exp(x - best), axis=0))


@triton.jit
def _argmax_final_kernel(val_ptr, idx_ptr, sum_ptr, out_ptr, lp_ptr, SLICES, BLOCK: tl.constexpr, PDL: tl.constexpr):
    pdl_prologue(PDL)
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


def argmax_logprob_rows(x: torch.Tensor, block: int = 4096, pdl: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of each row's largest value (the first one on ties, like torch.argmax) for x [M, V], int64 [M],
    and its log-probability under softmax(x), float32 [M]: one pass over the logits gives both, so a greedy
    step's logprobs cost nothing beyond its argmax (and are captured with it in the decode graphs).

    Rows must be free of NaN (logits are). ``pdl``: launched with programmatic dependent launch (``kernels.pdl``).
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
    _argmax_slices_kernel[(rows, slices)](x, vals, idx, sums, vocab, x.stride(0), slices, BLOCK=block,
                                          num_warps=8, **pdl_args(pdl))
    _argmax_final_kernel[(rows,)](vals, idx, sums, out, logprob, slices,
                                  BLOCK=max(16, triton.next_power_of_2(slices)), **pdl_args(pdl))
    return out, logprob


def argmax_rows(x: torch.Tensor, block: int = 4096, pdl: bool = False) -> torch.Tensor:
    """Index of each row's largest value, int64 [M] (see ``argmax_logprob_rows``)."""
    return argmax_logprob_rows(x, block, pdl)[0]
