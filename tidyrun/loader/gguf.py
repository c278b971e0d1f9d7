"""GGUF files (llama.cpp) -> ModelConfig + HF-named float weights + tokenizer.

Dequantisation is the ``gguf`` package's, the header is read by ``gguf_header`` (seconds faster than
gguf's reader); this module maps llama.cpp's names and layouts onto the Hugging Face convention the model uses.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import MappingProxyType

import numpy as np
import torch

from ..config import ModelConfig, RopeScaling
from ..errors import ModelLoadError, UnsupportedModelError
from ..tokenizer import Tokenizer
from .gguf_header import GGUFHeader

# GGUF architecture name -> tidyrun architecture. Mistral GGUFs say "llama".
_ARCHITECTURES = MappingProxyType({"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                                   "gemma3": "gemma3"})

# Per-layer tensor suffix in GGUF -> HF suffix under model.layers.N.
_LAYER_NAMES = MappingProxyType({
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
})
# Gemma 3 names its norms differently: ffn_norm is the norm before the MLP, and two more follow the sublayers.
_GEMMA3_LAYER_NAMES = MappingProxyType(dict(_LAYER_NAMES) | {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
})
# What llama.cpp does not store for Gemma 3 and hard-codes: every 6th layer global, the windowed layers' RoPE base.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_THETA = 10000.0
_GLOBAL_NAMES = MappingProxyType({
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
})


def _open_reader(path: str) -> GGUFHeader:
    try:
        return GGUFHeader(path)
    except Exception as exc:  # ValueError, struct/numpy errors, UnicodeDecodeError...
        raise ModelLoadError(f"cannot read GGUF file {path!r}: {type(exc).__name__}: {exc}") from exc


def _field(reader: GGUFHeader, key: str, default=None, required: bool = True):
    value = reader.fields.get(key)
    if value is None:
        if required and default is None:
            raise ModelLoadError(f"GGUF file {reader.path!r} lacks metadata key {key!r}")
        return default
    return value


def _dequantize_q4_1(data: np.ndarray) -> torch.Tensor:
    """Q4_1 blocks (fp16 scale d, fp16 minimum m, 32 four-bit values: the first 16 in the low nibbles) as
    float32 ``d * q + m``, rounded as gguf's numpy code rounds it (the product, then the sum). Why not gguf's:
    it dequantizes in groups of 16 rows through ~12k numpy calls, 1.5 s of the default model's 2.9 s engine
    start (profiled); whole-tensor torch ops give the same bits (tested) in a fraction of that."""
    blocks = torch.from_numpy(np.array(data, dtype=np.uint8)).reshape(-1, 20)  # a writable copy of the bytes
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()
    low = blocks[:, 2:4].contiguous().view(torch.float16).float()
    packed = blocks[:, 4:]
    values = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()
    return (scale * values + low).reshape(-1)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's rotary row permutation of attn_q / attn_k (back to HF layout)."""
    out_dim = w.shape[0]
    return w.reshape(n_head, out_dim // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class GGUFSource:
    """A GGUF checkpoint on disk. Holds its parsed header; weights are dequantized per call."""

    def __init__(self, path: str) -> None:
        self.path = path
        # Keep the header: its read-only memory map of the file serves every later weight read.
        self._reader = _open_reader(path)
        self.config = self._read_config(self._reader)
        if "rope_freqs.weight" in {t.name for t in self._reader.tensors}:
            raise UnsupportedModelError(
                f"{path!r} uses per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style); "
                "load the Hugging Face folder of this model instead"
            )

    def _read_config(self, reader: GGUFHeader) -> ModelConfig:
        gguf_arch = _field(reader, "general.architecture")
        if gguf_arch not in _ARCHITECTURES:
            raise UnsupportedModelError(
                f"GGUF architecture {gguf_arch!r} in {self.path!r} is not supported; "
                f"supported: {', '.join(sorted(_ARCHITECTURES))}"
            )
        a = gguf_arch
        hidden = int(_field(reader, f"{a}.embedding_length"))
        heads = int(_field(reader, f"{a}.attention.head_count"))
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = _field(reader, f"{a}.vocab_size", default=len(tokens) if tokens else None)
        scaling = None
        scaling_type = _field(reader, f"{a}.rope.scaling.type", required=False)
        if scaling_type not in (None, "none"):
            if scaling_type != "linear":
                raise UnsupportedModelError(f"GGUF rope scaling type {scaling_type!r} is not supported")
            scaling = RopeScaling("linear", float(_field(reader, f"{a}.rope.scaling.factor")))
        eos = _field(reader, "tokenizer.ggml.eos_token_id", required=False)
        layers = int(_field(reader, f"{a}.block_count"))
        head_dim = int(_field(reader, f"{a}.attention.key_length", default=hidden // heads))
        extra = {}
        if a == "gemma3":
            window = int(_field(reader, f"{a}.attention.sliding_window"))
            # llama.cpp's rule: the 27B model (62 layers) scales queries by hidden / heads, the others by head_dim.
            extra = dict(sliding_windows=tuple(0 if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else window
                                               for i in range(layers)),
                         rope_local_theta=_GEMMA3_LOCAL_THETA,
                         query_pre_attn_scalar=float(hidden // heads if layers == 62 else head_dim))
        try:
            return ModelConfig(
                architecture=_ARCHITECTURES[a],
                vocab_size=int(vocab),
                hidden_size=hidden,
                intermediate_size=int(_field(reader, f"{a}.feed_forward_length")),
                num_layers=layers,
                num_heads=heads,
                num_kv_heads=int(_field(reader, f"{a}.attention.head_count_kv", default=heads)),
                head_dim=head_dim,
                rms_norm_eps=float(_field(reader, f"{a}.attention.layer_norm_rms_epsilon")),
                rope_theta=float(_field(reader, f"{a}.rope.freq_base", default=10000.0)),
                max_position_embeddings=int(_field(reader, f"{a}.context_length")),
                tie_word_embeddings="output.weight" not in {t.name for t in reader.tensors},
                attention_bias=any(t.name.endswith("attn_q.bias") for t in reader.tensors),
                qk_norm=any(t.name.endswith("attn_q_norm.weight") for t in reader.tensors),
                **extra,
                rope_scaling=scaling,
                bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id", required=False),
                eos_token_ids=() if eos is None else (int(eos),),
            )
        except (TypeError, ValueError) as exc:
            raise ModelLoadError(f"GGUF metadata in {self.path!r} is malformed: {exc}") from exc

    def _hf_name(self, name: str) -> str:
        if name in _GLOBAL_NAMES:
            return _GLOBAL_NAMES[name]
        parts = name.split(".", 2)
        layer_names = _GEMMA3_LAYER_NAMES if self.config.architecture == "gemma3" else _LAYER_NAMES
        if len(parts) == 3 and parts[0] == "blk" and parts[2] in layer_names:
            return f"model.layers.{int(parts[1])}.{layer_names[parts[2]]}"
        raise ModelLoadError(f"GGUF tensor {name!r} in {self.path!r} has no known meaning for a Llama-family model")

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        import gguf

        cfg = self.config
        for t in self._reader.tensors:
            hf_name = self._hf_name(t.name)
            shape = tuple(int(d) for d in reversed(t.shape))  # GGUF stores ggml (reversed) order
            try:  # a float32 tensor of its own: gguf's arrays are copied out of the read-only map
                w = (_dequantize_q4_1(t.data) if t.tensor_type == gguf.GGMLQuantizationType.Q4_1
                     else torch.tensor(np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)))
            except NotImplementedError as exc:
                raise UnsupportedModelError(
                    f"tensor {t.name!r} uses GGML type {t.tensor_type.name}, which cannot be dequantized"
                ) from exc
            except Exception as exc:
                raise ModelLoadError(f"tensor {t.name!r} in {self.path!r} is corrupt: {exc}") from exc
            if w.numel() != int(np.prod(shape)):
                raise ModelLoadError(f"tensor {t.name!r} holds {w.numel()} values, its header says {shape}")
            w = w.reshape(shape)
            if cfg.architecture == "gemma3" and t.name.endswith("norm.weight"):
                w = w - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added (as transformers reads them)
            if cfg.architecture in ("llama", "mistral"):
                if t.name.endswith("attn_q.weight") or t.name.endswith("attn_q.bias"):
                    w = _unpermute(w, cfg.num_heads)
                elif t.name.endswith("attn_k.weight") or t.name.endswith("attn_k.bias"):
                    w = _unpermute(w, cfg.num_kv_heads)
            yield hf_name, w

    def load_tokenizer(self) -> Tokenizer:
        return Tokenizer(gguf_hf_tokenizer(self.path), eos_token_ids=self.config.eos_token_ids)


def gguf_hf_tokenizer(path: str, *args, **kwargs):
    """The transformers tokenizer built from GGUF file ``path``'s metadata (``args`` / ``kwargs`` go to
    ``from_pretrained``); ModelLoadError if it cannot be built. The fast tokenizer class directly:
    AutoTokenizer first builds the model's whole config from the file with gguf's reader (12 s of the 13 s
    for the default model), only to pick this same class."""
    from transformers import PreTrainedTokenizerFast

    folder, name = os.path.split(os.path.abspath(path))
    try:
        return PreTrainedTokenizerFast.from_pretrained(folder, *args, gguf_file=name, **kwargs)
    except Exception as exc:
        raise ModelLoadError(f"cannot build the tokenizer from GGUF file {path!r}: {exc}") from exc
