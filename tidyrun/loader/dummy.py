"""load_format="dummy": a model source whose weights are random, of the checkpoint's names and shapes.

verl builds its rollout engine with ``load_format="dummy"`` and pushes the
trainer's weights right after: reading the checkpoint's weights first would
only cost time. The config and tokenizer still come from the real source.
Values are drawn as vLLM's dummy loader draws them (uniform in [-1e-3,
1e-3]) from a fixed seed, so every tensor-parallel rank, and every re-read
(a level-2 wake, ``reload_weights``), produces the same tensors.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from ..config import ModelConfig
from ..tokenizer import Tokenizer

DUMMY_SEED = 1234
DUMMY_RANGE = 1e-3


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> full shape of every weight a checkpoint of ``cfg`` holds (the model's ``weight_shards`` agree)."""
    h, q, kv, inter, vocab = cfg.hidden_size, cfg.q_size, cfg.kv_size, cfg.intermediate_size, cfg.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h)}
    for i in range(cfg.num_layers):
        pre = f"model.layers.{i}."
        shapes |= {pre + "input_layernorm.weight": (h,), pre + "post_attention_layernorm.weight": (h,),
                   pre + "self_attn.o_proj.weight": (h, q), pre + "mlp.down_proj.weight": (h, inter)}
        if cfg.fused_checkpoint:
            shapes |= {pre + "self_attn.qkv_proj.weight": (q + 2 * kv, h), pre + "mlp.gate_up_proj.weight": (2 * inter, h)}
        else:
            shapes |= {pre + "self_attn.q_proj.weight": (q, h), pre + "self_attn.k_proj.weight": (kv, h),
                       pre + "self_attn.v_proj.weight": (kv, h),
                       pre + "mlp.gate_proj.weight": (inter, h), pre + "mlp.up_proj.weight": (inter, h)}
        if cfg.attention_bias:
            shapes |= ({pre + "self_attn.qkv_proj.bias": (q + 2 * kv,)} if cfg.fused_checkpoint else
                       {pre + "self_attn.q_proj.bias": (q,), pre + "self_attn.k_proj.bias": (kv,),
                        pre + "self_attn.v_proj.bias": (kv,)})
        if cfg.architecture == "gemma3":
            shapes |= {pre + "pre_feedforward_layernorm.weight": (h,), pre + "post_feedforward_layernorm.weight": (h,)}
        if cfg.qk_norm:
            shapes |= {pre + "self_attn.q_norm.weight": (cfg.head_dim,), pre + "self_attn.k_norm.weight": (cfg.head_dim,)}
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (vocab, h)
    return shapes


class DummyWeightsSource:
    """Another source's config and tokenizer, with random weights instead of its files' (see module docstring)."""

    def __init__(self, source) -> None:
        self._source = source
        self.path = source.path
        self.config: ModelConfig = source.config

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        gen = torch.Generator().manual_seed(DUMMY_SEED)
        for name, shape in checkpoint_shapes(self.config).items():
            yield name, torch.empty(shape).uniform_(-DUMMY_RANGE, DUMMY_RANGE, generator=gen)

    def load_tokenizer(self) -> Tokenizer:
        return self._source.load_tokenizer()
