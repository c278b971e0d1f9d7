"""The few operations of a decoder layer that have two implementations: plain torch and Triton.

``TorchOps`` is the reference path (the CPU, and the ground truth in GPU
tests); ``TritonOps`` runs the fused kernels of ``tidyrun.kernels`` on CUDA.
A runner picks one when it builds the model, so the same model code runs on
both. Neither holds any tensor between calls.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import AttentionMetadata, ForwardContext, paged_attention_reference, store_kv
from ..sampling import race_sample
from .layers import apply_rope


def split_heads(qkv: torch.Tensor, shape: tuple[int, int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Views q [T, heads, D], k and v [T, kv_heads, D] of a fused QKV projection output."""
    heads, kv_heads, head_dim = shape
    tokens = qkv.shape[0]
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)


class TorchOps:
    """Reference implementations in plain torch (any device)."""

    name = "torch"
    keyed_race = False  # race_sample takes drawn noise (see the Triton ops)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first largest index (int64 [rows])."""
        return logits.argmax(dim=-1)

    def take_pending(self, input_ids: torch.Tensor, pending: torch.Tensor) -> None:
        """Async scheduling: an input id -1 - r (``host_batch``: a token not on the host yet) becomes row r
        of ``pending``, the tokens of the step launched before this one; in place, on the device."""
        if pending.numel():
            rows = (-1 - input_ids).clamp_(0, pending.numel() - 1)
            input_ids.copy_(torch.where(input_ids < 0, pending[rows], input_ids))

    def argmax_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's argmax and its log-probability (float32): a greedy step's token and logprob."""
        x = logits.float()
        at = logits.argmax(dim=-1)
        return at, x.gather(-1, at[:, None])[:, 0] - x.logsumexp(dim=-1)

    def race_sample(self, logits: torch.Tensor, noise: torch.Tensor, scale: torch.Tensor, want_logprob: bool,
                    bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Sampled (or greedy) tokens by the exponential race (among a grammar ``bitmask``'s allowed tokens),
        and optionally (token, logprob, rank) rows. ``noise``: Exp(1) draws (the Triton race also takes
        int64 [rows, 2] keys, ``keyed_race``)."""
        return race_sample(logits, noise, scale, want_logprob, bitmask)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return weight * h.to(x.dtype), x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def linear_silu_mul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """``silu(x gate^T) * (x up^T)`` for a weight [2I, in] holding the gate rows then the up rows."""
        return self.silu_mul(self.linear(x, weight, None))

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
        """``sum_j weights[t, j] * expert_ids[t, j](x[t])`` for SwiGLU experts stacked as ``w13`` [E, 2I, H]
        (gate rows, then up rows) and ``w2`` [E, H, I]; ``weights`` [T, k] (float32, or the model dtype where
        the family rounds them first), ``ids`` [T, k].

        The reference, as transformers computes it: one product per expert over the tokens routed to it,
        added up in expert order. It asks the host which experts were hit, so it is never captured in a CUDA
        graph (graphs run the Triton path)."""
        out = torch.zeros_like(x)
        for e in ids.unique().tolist():
            token, slot = (ids == e).nonzero(as_tuple=True)
            h = F.linear(self.silu_mul(F.linear(x[token], w13[e])), w2[e])
            out.index_add_(0, token, (h * weights[token, slot, None]).to(x.dtype))  # float32 weights: one rounding
        return out

    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        """What each layer's ``rope_and_store`` needs: here, the gathered cos/sin rows."""
        return rotary(positions, dtype)

    def rope_and_store(self, qkv: torch.Tensor, rope, shape: tuple[int, int, int], kv: tuple | None,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split ``qkv``, rotate q and k, write k/v to the cache (when ``kv`` is given); returns q, k, v."""
        q, k, v = split_heads(qkv, shape)
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if kv is not None:
            store_kv(k, v, kv[0], kv[1], meta.slot_mapping)
        return q, k, v

    def attention(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                  scale: float, window: int | None = None) -> torch.Tensor:
        """Paged attention; ``window``: a sliding-window layer's width (None: the whole context)."""
        return paged_attention_reference(q, kv[0], kv[1], meta, scale, window)


class TritonOps(TorchOps):
    """Fused Triton kernels (CUDA). KV-free attention (pooling) keeps the torch path.

    ``ctx`` is the runner's ForwardContext: inside a step, split kernels take
    the step's arrival counters from it and finish their reductions in-kernel.
    ``batch_invariant``: every product runs ``kernels.linear`` whatever its
    rows (cuBLAS's algorithm, and so a row's bits, depend on the row count);
    narrow products of 17-128 rows as 16-row blocks of the few-row launch
    (``_split_grid``).
    ``pdl``: the layer's kernels (norms, products, RoPE, attention, argmax) are
    launched with programmatic dependent launch (``kernels.pdl``: Hopper and
    later), so each one's launch overlaps the end of the kernel before.
    ``tma``: the many-row products take their tiles by tensor descriptors
    (``kernels.linear``: Hopper and later; the same bits).
    """

    name = "triton"
    BLOCK_ROWS_MAX = 128  # batch-invariant narrow products up to this many rows run in 16-row blocks (_split_grid)
    keyed_race = True  # race_sample also takes each row's key and draws its noise in the kernel

    def __init__(self, num_sms: int, ctx: ForwardContext | None = None, float32_kernels: bool = False,
                 batch_invariant: bool = False, pdl: bool = False, tma: bool = False) -> None:
        from ..kernels import argmax, attention, fused, linear, moe, race  # the CPU path never needs Triton

        self._attn = attention
        self._moe = moe
        self._race = race
        self._fused = fused
        self._linear = linear
        self._argmax = argmax
        self._num_sms = num_sms
        self._ctx = ctx
        self._float32_kernels = float32_kernels  # float32 products stay on cuBLAS unless asked (interpreter tests)
        # Every product through the kernel, for any number of rows: one reduction order per weight.
        self._batch_invariant = batch_invariant
        self.pdl = pdl
        self._tma = tma
        # (out, in features, gated) -> LinearPlan, or None where cuBLAS takes the product
        self._plans: dict[tuple[int, int, bool], object] = {}

    def _plan(self, x: torch.Tensor, weight: torch.Tensor, gated: bool = False):
        """The kernel's plan for this product, or None for cuBLAS (many rows, float32, wide outputs) unless
        every product must be batch-invariant."""
        key = (*weight.shape, gated)
        if key not in self._plans:
            lin = self._linear
            plan = (lin.gated_plan if gated else lin.narrow_plan)(*weight.shape, self._num_sms)
            if plan is None and self._batch_invariant:
                plan = lin.wide_plan(*weight.shape, self._num_sms)
            self._plans[key] = plan
        if self._batch_invariant:
            return self._plans[key]
        if (x.shape[0] > self._linear.FEW_ROWS or (x.dtype == torch.float32 and not self._float32_kernels)
                or x.stride(-1) != 1 or not weight.is_contiguous()):
            return None
        return self._plans[key]

    def _counters(self) -> torch.Tensor | None:
        return None if self._ctx is None else self._ctx.split_counters

    def _split_grid(self, x: torch.Tensor, weight: torch.Tensor, plan) -> bool | None:
        """True where a batch-invariant product of more than 16 rows runs the few-row launch in 16-row blocks
        (each block is the program a lone row gets: the same bits by construction); None: the rows pick.

        Blocks re-read the weight once per 16 rows (from L2), so they pay only where the many-row launch
        leaves SMs idle: a narrow weight (a few-row grid of at most two programs per SM: o, down, QKV of the
        1.2B shape) and up to ``BLOCK_ROWS_MAX`` rows. On the H100, per product at 32 / 64 / 128 rows
        (docs/BENCHMARKS.md): down 20.7 / 30.4 / 54.8 us against the many-row launch's 38.8 / 39.0 / 70.8;
        gate/up (gated: not called) and the LM head (hundreds of programs already) lose beyond 16-32 rows."""
        rows = x.shape[0]
        if not self._batch_invariant or rows <= self._linear.FEW_ROWS or rows > self.BLOCK_ROWS_MAX:
            return None
        programs = -(-weight.shape[0] // plan.block_n) * -(-weight.shape[1] // plan.k_seg)
        return True if programs <= 2 * self._num_sms else None

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        plan = self._plan(x, weight)
        if plan is None:
            return F.linear(x, weight, bias)
        return self._linear.linear(x.contiguous(), weight.contiguous(), bias, plan, self._counters(),
                                   split_grid=self._split_grid(x, weight, plan), pdl=self.pdl, tma=self._tma)

    def linear_silu_mul(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        plan = self._plan(x, weight, gated=True)
        if plan is None:
            return super().linear_silu_mul(x, weight)
        return self._linear.linear(x.contiguous(), weight.contiguous(), None, plan, gated=True, pdl=self.pdl,
                                   tma=self._tma)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return self._argmax.argmax_rows(logits, pdl=self.pdl)

    def take_pending(self, input_ids: torch.Tensor, pending: torch.Tensor) -> None:
        self._fused.take_pending(input_ids, pending)  # one launch instead of torch's six

    def argmax_logprob(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._argmax.argmax_logprob_rows(logits, pdl=self.pdl)

    def race_sample(self, logits: torch.Tensor, noise: torch.Tensor, scale: torch.Tensor, want_logprob: bool,
                    bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return self._race.race_sample(logits, noise, scale, want_logprob, bitmask)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return self._fused.add_rms_norm(x, residual, weight, eps, self.pdl)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fused.silu_mul(gate_up, self.pdl)

    def moe_experts(self, x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor,
                    ids: torch.Tensor) -> torch.Tensor:
        return self._moe.moe_experts(x, w13, w2, weights, ids)

    def rope_tables(self, rotary, positions: torch.Tensor, dtype: torch.dtype):
        """The whole float32 tables and the positions: the kernel gathers the rows itself."""
        return rotary.cos, rotary.sin, positions

    def rope_and_store(self, qkv: torch.Tensor, rope, shape: tuple[int, int, int], kv: tuple | None,
                       meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cos, sin, positions = rope
        k_cache, v_cache = kv if kv is not None else (None, None)
        self._fused.rope_and_store(qkv, cos, sin, positions, *shape, meta.slot_mapping if kv is not None else None,
                                   k_cache, v_cache, self.pdl)  # in place: the split below sees rotated q and k
        return split_heads(qkv, shape)

    def attention(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                  scale: float, window: int | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        return self._attn.paged_attention(q, kv[0], kv[1], out, meta.tile_seq, meta.tile_q0, meta.query_start_loc,
                                          meta.seq_lens, meta.block_tables, scale, meta.block_q, meta.block_m,
                                          meta.splits, window, self.pdl)

