"""Building blocks of Llama-family models.

Parameters are created on the meta device (shape and dtype, no memory): the
runner's WeightArena places all of them in one device buffer and the loader
fills it. Running a random initialiser over a billion parameters only to
overwrite them would cost seconds for nothing.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig, RopeScaling


def _param(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, device="meta", dtype=dtype), requires_grad=False)


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with a weight laid out [out_features, in_features] like HF.

    The product is ``ops.linear``: cuBLAS, or on CUDA for a few rows (or any
    number, batch-invariant) a kernel sized to the machine (``tidyrun.kernels.linear``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, ops, dtype: torch.dtype):
        super().__init__()
        self._ops = ops
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.bias = _param(out_features, dtype=dtype) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._ops.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """Token embeddings: the whole vocabulary, or (tensor parallel) rows [start, start + num_embeddings).

    A vocabulary-parallel shard looks up zeros for ids outside its rows and
    the ranks' partial results are summed (``tp.all_reduce``), so every rank
    ends with the full embeddings.
    """

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, start: int = 0, tp=None):
        super().__init__()
        self.weight = _param(num_embeddings, dim, dtype=dtype)
        self.start = start
        self._tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self._tp is None:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self._tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 like HF's, optionally adding a residual first.

    ``forward(x, residual)`` returns ``(norm(x + residual), x + residual)``, so
    each decoder layer does one add-and-norm instead of two passes. The
    arithmetic is ``ops.add_rms_norm`` (torch reference or one fused kernel).
    """

    def __init__(self, dim: int, eps: float, ops, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self._ops = ops
        self.weight = _param(dim, dtype=dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        return self._ops.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies (float32, CPU), with linear or Llama-3 scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.inv_freq:  # yarn, dynamic, longrope: transformers' own values (loader.hf._rope_from_transformers)
        if len(scaling.inv_freq) != head_dim // 2:
            raise ValueError(f"{scaling.rope_type} RoPE has {len(scaling.inv_freq)} frequencies for head_dim {head_dim}")
        return torch.tensor(scaling.inv_freq, dtype=torch.float32)
    # llama3: keep high frequencies, divide low ones by factor, blend in between.
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    blended = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(nn.Module):
    """Per-model cos/sin table for positions [0, max_positions).

    The table is a buffer of this module (not a module-level cache), so it is
    owned, tracked and freed with the model it belongs to. ``build`` computes
    it on a device, ``release`` drops it (sleep); both are the runner's calls.
    """

    def __init__(self, cfg: ModelConfig, max_positions: int, theta: float | None = None,
                 scaling: RopeScaling | None | str = "config"):
        """``theta``/``scaling``: another base and scaling than the config's (Gemma 3's windowed layers)."""
        super().__init__()
        scaling = cfg.rope_scaling if isinstance(scaling, str) else scaling
        self._inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta if theta is None else theta, scaling)
        self._magnitude = 1.0 if scaling is None else scaling.attention_factor
        self.max_positions = max_positions
        self.register_buffer("cos", torch.empty(0, device="meta"), persistent=False)
        self.register_buffer("sin", torch.empty(0, device="meta"), persistent=False)

    def build(self, device: torch.device) -> None:
        freqs = torch.arange(self.max_positions, dtype=torch.float32)[:, None] * self._inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * self._magnitude).to(device)
        self.sin = (emb.sin() * self._magnitude).to(device)

    def release(self) -> None:
        self.cos = torch.empty(0, device="meta")
        self.sin = torch.empty(0, device="meta")

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows for ``positions``, shaped [T, 1, head_dim] to broadcast over heads."""
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on [T, heads, head_dim] (HF layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
