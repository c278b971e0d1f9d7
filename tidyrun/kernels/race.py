"""Sampling by an exponential race, with the sampled token's log-probability and rank, in two kernels.

A row samples softmax(x / T) by taking argmax(x / T - log E) with E ~ Exp(1)
drawn per token (the exponential race; ``tidyrun.sampling.race_sample`` is
the torch reference). Rows with no top-k, top-p or min-p filter need no sort
of the vocabulary: one pass over the logits picks the token and, in the same
pass, the row's max and sum of exponentials (its logsumexp); the finishing
kernel combines the slices and, when asked, counts the tokens above the
sampled one (its rank) and writes (token, logprob, rank) packed as float64,
so a step with ``logprobs=0`` costs one copy to the host, as without.
A seeded row's noise is drawn in the slice kernel from its key (``KEYED``:
the row's seed and the index of the token it samples, Philox), never
stored: drawing it from the row's ``torch.Generator`` is one launch per row
(64-256 a step at batch 64-256) and a [rows, vocab] float32 tensor written
and read back.
With a grammar's bitmask (``MASKED``) only the allowed tokens race, while the
logsumexp, logprob and rank stay those of the raw logits ("raw_logprobs"):
a structured step needs no float copy of its logits, no masking launches.
Measured on the H200 (docs/BENCHMARKS.md): torch's sort-based path plus
separate logprob ops cost +26% on a 1.2B model's batch-1 step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _keyed_exponential(keys_ptr, row, cols):
    """Exp(1) draws for ``cols`` of one row from its key (int64 seed, int64 step): Philox keyed by the seed's
    64 bits, counting (column, step), so a row's noise depends on nothing but its own key. E = -log(U) with U
    uniform in [0, 1) (31 bits); U = 0 gives E = inf, a token that cannot win (a 2**-30 event per token)."""
    seed = tl.load(keys_ptr + row * 2)
    step = tl.load(keys_ptr + row * 2 + 1)
    c0 = cols.to(tl.uint32)
    zero = tl.zeros_like(c0)
    r, _, _, _ = tl.philox(seed, c0, zero + step.to(tl.uint32), zero + (step >> 32).to(tl.uint32), zero)
    return -tl.log(tl.uint_to_uniform_float(r))


@triton.jit
def _race_slices_kernel(x_ptr, noise_ptr, scale_ptr, mask_ptr, max_ptr, sum_ptr, rval_ptr, ridx_ptr, V, stride_x,
                        stride_n, stride_m, SLICES, LOGPROB: tl.constexpr, MASKED: tl.constexpr, KEYED: tl.constexpr,
                        BLOCK: tl.constexpr):
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    inside = cols < V
    inv_t = tl.load(scale_ptr + row * 2)
    noisy = tl.load(scale_ptr + row * 2 + 1)
    x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=-float("inf")).to(tl.float32)
    # Greedy rows read no noise (E = 1: the race is the argmax). E is kept above 0 so log(E) stays finite.
    if KEYED:  # noise_ptr holds int64 (seed, step) per row: the noise is drawn here, never stored
        e = tl.where(noisy != 0.0, _keyed_exponential(noise_ptr, row, cols), 1.0)
    else:
        e = tl.load(noise_ptr + row * stride_n + cols, mask=cols < tl.where(noisy != 0.0, V, 0), other=1.0)
    race = tl.where(inside, x * inv_t - tl.log(tl.maximum(e, 1e-30)), -float("inf"))
    # Bit c % 32 of word c // 32 set: token c allowed (a grammar's mask); the logsumexp stays raw. A row that
    # allows nothing gets token 0, as the argmax over a row of -inf does on the processed path.
    if MASKED:
        words = tl.load(mask_ptr + row * stride_m + cols // 32, mask=inside, other=0)
        race = tl.where(((words >> (cols % 32)) & 1) != 0, race, -float("inf"))
    best, at = tl.max(race, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(rval_ptr + row * SLICES + part, best)
    tl.store(ridx_ptr + row * SLICES + part, part * BLOCK + at)
    if LOGPROB:
        top = tl.max(x, axis=0)
        total = tl.sum(tl.exp(x - top), axis=0)
        tl.store(max_ptr + row * SLICES + part, top)
        tl.store(sum_ptr + row * SLICES + part, tl.where(top == -float("inf"), 0.0, total))


@triton.jit
def _race_final_kernel(x_ptr, max_ptr, sum_ptr, rval_ptr, ridx_ptr, tok_ptr, out_ptr, V, stride_x, SLICES,
                       BLOCK_S: tl.constexpr, LOGPROB: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    parts = tl.arange(0, BLOCK_S)
    valid = parts < SLICES
    rvals = tl.load(rval_ptr + row * SLICES + parts, mask=valid, other=-float("inf"))
    ridx = tl.load(ridx_ptr + row * SLICES + parts, mask=valid, other=0)
    _, at = tl.max(rvals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tok = tl.sum(tl.where(parts == at, ridx, 0), axis=0)
    tl.store(tok_ptr + row, tok.to(tl.int64))
    if LOGPROB:
        tops = tl.load(max_ptr + row * SLICES + parts, mask=valid, other=-float("inf"))
        sums = tl.load(sum_ptr + row * SLICES + parts, mask=valid, other=0.0)
        top = tl.max(tops, axis=0)
        lse = top + tl.log(tl.sum(tl.where(tops > -float("inf"), sums * tl.exp(tops - top), 0.0), axis=0))
        value = tl.load(x_ptr + row * stride_x + tok).to(tl.float32)
        above = tl.full((), 0, tl.int32)
        for start in range(0, V, BLOCK):  # the rank: the row comes back from L2, not HBM
            cols = start + tl.arange(0, BLOCK)
            xs = tl.load(x_ptr + row * stride_x + cols, mask=cols < V, other=-float("inf")).to(tl.float32)
            above += tl.sum((xs > value).to(tl.int32), axis=0)
        tl.store(out_ptr + row * 3, tok.to(tl.float64))
        tl.store(out_ptr + row * 3 + 1, (value - lse).to(tl.float64))
        tl.store(out_ptr + row * 3 + 2, (above + 1).to(tl.float64))


@triton.jit
def _keyed_noise_kernel(keys_ptr, out_ptr, V, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + row * V + cols, _keyed_exponential(keys_ptr, row, cols), mask=cols < V)


def keyed_noise(keys: torch.Tensor, vocab: int, block: int = 1024) -> torch.Tensor:
    """The noise (float32 [B, vocab]) that ``race_sample`` draws inside its kernel from ``keys`` (int64 [B, 2]:
    seed, step): for tests, which race the same noise through the stored-noise path and the torch reference."""
    out = torch.empty(keys.shape[0], vocab, dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _keyed_noise_kernel[(keys.shape[0], triton.cdiv(vocab, block))](keys.contiguous(), out, vocab, BLOCK=block)
    return out


def race_sample(logits: torch.Tensor, noise: torch.Tensor, scale: torch.Tensor, want_logprob: bool,
                bitmask: torch.Tensor | None = None, block: int = 4096) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Same contract as ``tidyrun.sampling.race_sample``: tokens int64 [B] and, with ``want_logprob``,
    float64 [B, 3] rows of (token, log-probability under softmax(logits), 1-based rank); ``bitmask`` (int32
    [B, ceil(V / 32)] on the logits' device): only its allowed tokens race. ``noise`` is either the Exp(1)
    draws (float32 [B, V]) or each row's key (int64 [B, 2]: seed, step), from which the kernel draws them."""
    rows, vocab = logits.shape
    keyed = noise.dtype == torch.int64
    if keyed and (tuple(noise.shape) != (rows, 2) or noise.device != logits.device):
        raise ValueError(f"race_sample's keys must be int64 [{rows}, 2] (seed, step) on {logits.device}, "
                         f"got {tuple(noise.shape)} on {noise.device}")
    if logits.stride(1) != 1 or noise.stride(1) != 1 or not scale.is_contiguous():
        raise ValueError("race_sample needs rows with contiguous columns and a contiguous scale [B, 2]")
    if bitmask is not None and (bitmask.dtype != torch.int32 or bitmask.shape != (rows, (vocab + 31) // 32)
                                or bitmask.stride(1) != 1 or bitmask.device != logits.device):
        raise ValueError(f"race_sample's bitmask must be int32 [{rows}, {(vocab + 31) // 32}] with contiguous "
                         f"rows on {logits.device}, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    packed = torch.empty(rows, 3, dtype=torch.float64, device=logits.device) if want_logprob else None
    if rows == 0:
        return tokens, packed
    slices = triton.cdiv(vocab, block)
    rvals = torch.empty(rows, slices, dtype=torch.float32, device=logits.device)
    ridx = torch.empty(rows, slices, dtype=torch.int32, device=logits.device)
    tops = torch.empty_like(rvals) if want_logprob else rvals
    sums = torch.empty_like(rvals) if want_logprob else rvals
    masked = bitmask is not None
    _race_slices_kernel[(rows, slices)](logits, noise, scale, bitmask if masked else scale, tops, sums, rvals, ridx,
                                        vocab, logits.stride(0), noise.stride(0), bitmask.stride(0) if masked else 0,
                                        slices, LOGPROB=want_logprob, MASKED=masked, KEYED=keyed, BLOCK=block,
                                        num_warps=8)
    _race_final_kernel[(rows,)](logits, tops, sums, rvals, ridx, tokens, tokens if packed is None else packed,
                                vocab, logits.stride(0), slices, BLOCK_S=max(16, triton.next_power_of_2(slices)),
                                LOGPROB=want_logprob, BLOCK=block, num_warps=8)
    return tokens, packed
