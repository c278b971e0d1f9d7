"""Random-weight checkpoints of real model shapes, for benchmarks and tests.

Writes a normal Hugging Face folder (config.json, safetensors shards, a small
byte-level BPE tokenizer), so tidyrun and transformers load the very same
files. No hub access is needed: the tokenizer is trained on a built-in text.
"""

from __future__ import annotations

import json
import os
from types import MappingProxyType

import torch

SHAPES = MappingProxyType({
    # Llama-3.2-1B-like (the 1.2B shape used by the benchmarks).
    "llama-1.2b": MappingProxyType(dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32,
                                        num_key_value_heads=8, intermediate_size=8192, vocab_size=128256,
                                        max_position_embeddings=8192, tie_word_embeddings=True,
                                        rope_theta=500000.0)),
    # Llama-3-8B-like.
    "llama-8b": MappingProxyType(dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                      num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                      max_position_embeddings=8192, tie_word_embeddings=False,
                                      rope_theta=500000.0)),
    # Small enough for many CPU/GPU lifecycle cycles, large enough to show in memory readings.
    "llama-tiny": MappingProxyType(dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                        num_key_value_heads=2, intermediate_size=512, vocab_size=2048,
                                        max_position_embeddings=2048, tie_word_embeddings=False,
                                        rope_theta=10000.0)),
    # Qwen3-8B-like (per-head q/k norms, head_dim 128 apart from hidden / heads).
    "qwen3-8b": MappingProxyType(dict(model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
                                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                      intermediate_size=12288, vocab_size=151936, max_position_embeddings=40960,
                                      tie_word_embeddings=False, rope_theta=1000000.0)),
    # OLMoE-1B-7B-like: 64 experts, 8 routed per token (1.3B of 6.9B parameters active).
    "olmoe-1b-7b": MappingProxyType(dict(model_type="olmoe", hidden_size=2048, num_hidden_layers=16,
                                         num_attention_heads=16, num_key_value_heads=16, intermediate_size=1024,
                                         num_experts=64, num_experts_per_tok=8, norm_topk_prob=False,
                                         vocab_size=50304, max_position_embeddings=4096, tie_word_embeddings=False,
                                         rope_theta=10000.0)),
})
ARCHITECTURES = MappingProxyType({"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM",
                                  "olmoe": "OlmoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                  "mixtral": "MixtralForCausalLM"})

_CORPUS = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single step. "
    "To be, or not to be, that is the question. All that glitters is not gold. The capital of France is Paris. "
    "def main():\n    print('hello world')\n    return 0\n"
)


def write_tokenizer(out_dir: str, vocab_size: int = 512) -> None:
    """Train a byte-level BPE on a built-in text and save it as a HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(out_dir)


def write_random_checkpoint(out_dir: str, shape: str | dict = "llama-1.2b", dtype: torch.dtype = torch.bfloat16,
                            device: str = "cpu", seed: int = 0, shard_bytes: int = 4 << 30, std: float = 0.02) -> str:
    """Write a random-weight checkpoint of ``shape`` (a name in SHAPES or a config dict; ``model_type`` defaults
    to llama) to ``out_dir``.

    Weights are drawn on ``device`` (a GPU makes the 8B shape quick) and
    written shard by shard, so host memory stays at about one shard.
    """
    from safetensors.torch import save_file

    from .loader.hf import config_from_hf
    from .model.registry import checkpoint_shapes

    cfg = dict(SHAPES[shape]) if isinstance(shape, str) else dict(shape)
    os.makedirs(out_dir, exist_ok=True)
    model_type = cfg.pop("model_type", "llama")
    config = dict(cfg, model_type=model_type, architectures=[ARCHITECTURES[model_type]],
                  head_dim=cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"]),
                  rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=0, eos_token_id=1,
                  torch_dtype=str(dtype).removeprefix("torch."))
    # The names and shapes tidyrun's model reads (one source of truth: the model's own weight map).
    shapes = list(checkpoint_shapes(config_from_hf(config, out_dir)).items())

    gen = torch.Generator(device=device).manual_seed(seed)
    elem = torch.empty((), dtype=dtype).element_size()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, s in shapes:
        nbytes = elem * int(torch.Size(s).numel())
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = s  # placeholder: tensors are drawn when the shard is written
        size += nbytes
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" if len(shards) > 1 else "model.safetensors"
        tensors = {}
        for name, s in shard.items():
            if len(s) == 1:
                t = torch.ones(s, dtype=dtype, device=device)
            else:
                t = torch.randn(s, generator=gen, device=device, dtype=torch.float32).mul_(std).to(dtype)
            tensors[name] = t.cpu()
            weight_map[name] = fname
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    write_tokenizer(out_dir)
    return out_dir
