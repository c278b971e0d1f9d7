"""Hugging Face model folders: config.json + *.safetensors (single or sharded)."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from types import MappingProxyType

import torch

from ..config import ModelConfig, RopeScaling
from ..errors import InvalidRequestError, ModelLoadError, UnsupportedModelError
from ..sampling_params import SamplingParams
from ..tokenizer import Tokenizer

_MODEL_TYPES = MappingProxyType({"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
                                 "phi3": "phi3", "gemma3_text": "gemma3", "mixtral": "mixtral",
                                 "qwen3_moe": "qwen3_moe", "olmoe": "olmoe"})
# Tensors some checkpoints carry that are derived, not learned.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path!r}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path!r} must hold a JSON object")
    return data


def _rope(raw: dict) -> tuple[float, RopeScaling | None]:
    """RoPE theta and scaling from either the v4 (rope_theta/rope_scaling) or v5 (rope_parameters) keys."""
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or params
    rope_type = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(scaling["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            float(scaling["factor"]),
            float(scaling.get("low_freq_factor", 1.0)),
            float(scaling.get("high_freq_factor", 4.0)),
            int(scaling.get("original_max_position_embeddings", 8192)),
        )
    if rope_type in ("yarn", "dynamic", "longrope", "su"):  # "su": Phi-3's first name for longrope
        return theta, _rope_from_transformers(raw, "longrope" if rope_type == "su" else rope_type)
    raise UnsupportedModelError(
        f"rope scaling type {rope_type!r} is not supported (supported: linear, llama3, yarn, dynamic, longrope)")


def _rope_from_transformers(raw: dict, rope_type: str) -> RopeScaling:
    """transformers' own inverse frequencies and cos/sin factor for this config, as its model computes them
    for a sequence inside the original context (why not by hand: each variant is a page of arithmetic that
    transformers already keeps equal to the reference implementations)."""
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    try:
        hf = AutoConfig.for_model(raw["model_type"], **{k: v for k, v in raw.items() if k != "model_type"})
        inv_freq, attention = ROPE_INIT_FUNCTIONS[rope_type](hf, "cpu")
    except Exception as exc:  # noqa: BLE001 - a malformed rope_scaling; name it
        raise ModelLoadError(f"cannot compute {rope_type} RoPE from the config: {type(exc).__name__}: {exc}") from exc
    params = getattr(hf, "rope_parameters", None) or {}
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    return RopeScaling(rope_type, float(params.get("factor") or 1.0),
                       original_max_position_embeddings=int(original or raw.get("max_position_embeddings", 2048)),
                       inv_freq=tuple(float(f) for f in inv_freq.float().tolist()), attention_factor=float(attention))


def _gemma3(raw: dict, where: str) -> tuple[dict, dict]:
    """Gemma 3's extra fields, and the config as the global layers read it (their RoPE base and scaling)."""
    if raw.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"hidden_activation {raw['hidden_activation']!r} in {where!r} is not supported")
    for cap in ("attn_logit_softcapping", "final_logit_softcapping"):
        if raw.get(cap) is not None:
            raise UnsupportedModelError(f"{cap} in {where!r} is not supported (Gemma 2 style softcapping)")
    layers = int(raw["num_hidden_layers"])
    kinds = raw.get("layer_types") or [
        "full_attention" if (i + 1) % int(raw.get("sliding_window_pattern", 6)) == 0 else "sliding_attention"
        for i in range(layers)]
    window = int(raw.get("sliding_window") or 0)
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one RoPE per layer kind
        global_raw = {k: v for k, v in raw.items() if k != "rope_scaling"} | {"rope_parameters": params["full_attention"]}
        local_theta = float(params.get("sliding_attention", {}).get("rope_theta", 10000.0))
    else:
        global_raw, local_theta = raw, float(raw.get("rope_local_base_freq", 10000.0))
    extra = dict(sliding_windows=tuple(window if k == "sliding_attention" else 0 for k in kinds),
                 rope_local_theta=local_theta,
                 query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar") or raw.get("head_dim") or 256))
    return extra, global_raw


# transformers' default ``sliding_window`` when a config leaves the key out (Mixtral's and Phi-3's: none).
_DEFAULT_WINDOW = MappingProxyType({"mistral": 4096, "qwen2": 4096, "qwen3": 4096, "qwen3_moe": 4096})


def _sliding_windows(raw: dict, model_type: str, max_pos: int) -> tuple[int, ...]:
    """Each layer's attention window (0: the whole context), as transformers' models read the config:
    Mistral, Mixtral, Phi-3, OLMoE and Qwen3-MoE window every layer (Mistral and Mixtral ignore
    ``layer_types``); Qwen2 and Qwen3 window the layers ``layer_types`` marks, by default those from
    ``max_window_layers`` on; the Qwen families only with ``use_sliding_window`` (else transformers drops the
    window). A missing ``sliding_window`` key takes transformers' default for the family (``_DEFAULT_WINDOW``).
    () when no layer is windowed, or the window is no shorter than the context."""
    layers = int(raw["num_hidden_layers"])
    if model_type in ("qwen2", "qwen3", "qwen3_moe") and not raw.get("use_sliding_window", False):
        return ()
    window = int((raw["sliding_window"] if "sliding_window" in raw else _DEFAULT_WINDOW.get(model_type)) or 0)
    if not window or window >= max_pos:
        return ()
    if model_type in ("qwen2", "qwen3"):
        start = int(raw.get("max_window_layers", 28))
        kinds = raw.get("layer_types") or ["sliding_attention" if i >= start else "full_attention"
                                           for i in range(layers)]
    elif model_type in ("mistral", "mixtral", "phi3", "olmoe", "qwen3_moe"):
        kinds = ["sliding_attention"] * layers
    else:  # Llama's attention has no window
        return ()
    windows = tuple(window if k == "sliding_attention" else 0 for k in kinds)
    return windows if any(windows) else ()


def _moe(raw: dict, model_type: str, where: str) -> dict:
    """The mixture-of-experts fields of Mixtral, Qwen3-MoE and OLMoE (each family names them its own way)."""
    if raw.get("hidden_act", "silu") != "silu":
        raise UnsupportedModelError(f"hidden_act {raw['hidden_act']!r} in {where!r} is not supported (SiLU experts)")
    experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    extra = dict(num_experts=experts, num_experts_per_tok=int(raw["num_experts_per_tok"]),
                 moe_intermediate_size=int(raw.get("moe_intermediate_size") or raw["intermediate_size"]),
                 norm_topk_prob=bool(raw.get("norm_topk_prob", False)))
    if model_type == "mixtral":
        extra["norm_topk_prob"] = True  # Mixtral always renormalizes the chosen weights
    if model_type == "qwen3_moe":
        step = int(raw.get("decoder_sparse_step") or 1)
        only = set(raw.get("mlp_only_layers") or ())
        extra["dense_layers"] = tuple(i for i in range(int(raw["num_hidden_layers"]))
                                      if i in only or experts == 0 or (i + 1) % step)
    if model_type == "olmoe":
        if raw.get("clip_qkv") is not None:
            raise UnsupportedModelError(f"clip_qkv in {where!r} is not supported")
        extra["qk_norm_whole"] = True
    return extra


def config_from_hf(raw: dict, where: str) -> ModelConfig:
    """Translate a transformers config.json dict into a ModelConfig."""
    model_type = raw.get("model_type")
    if model_type == "gemma3":
        raise UnsupportedModelError(f"{where!r} is a multimodal Gemma 3 checkpoint; tidyrun runs Gemma 3's text "
                                    "models (model_type gemma3_text, e.g. gemma-3-1b)")
    if model_type not in _MODEL_TYPES:
        raise UnsupportedModelError(
            f"model_type {model_type!r} in {where!r} is not supported; supported: {', '.join(sorted(_MODEL_TYPES))}"
        )
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        extra, rope_raw = _gemma3(raw, where) if model_type == "gemma3_text" else ({}, raw)
        if model_type in ("mixtral", "qwen3_moe", "olmoe"):
            extra = _moe(raw, model_type, where)
        theta, scaling = _rope(rope_raw)
        max_pos = int(raw.get("max_position_embeddings", 2048))
        if model_type != "gemma3_text":
            extra["sliding_windows"] = _sliding_windows(raw, model_type, max_pos)
        if scaling is not None and scaling.rope_type == "longrope":
            # transformers switches every position to the long factors once a sequence outgrows the original
            # context; a per-position table is exact only inside it (the short factors), so the context stops there.
            max_pos = min(max_pos, scaling.original_max_position_embeddings)
        partial = float((raw.get("rope_parameters") or {}).get("partial_rotary_factor",
                                                               raw.get("partial_rotary_factor", 1.0)))
        if partial != 1.0:
            raise UnsupportedModelError(f"partial_rotary_factor {partial} in {where!r} is not supported (RoPE over "
                                        "the whole head only)")
        eos = raw.get("eos_token_id")
        eos_ids = tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return ModelConfig(
            architecture=_MODEL_TYPES[model_type],
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", model_type == "gemma3_text")),
            attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "gemma3_text", "qwen3_moe", "olmoe"),
            fused_checkpoint=model_type == "phi3",
            **extra,
            rope_scaling=scaling,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )
    except KeyError as exc:
        raise ModelLoadError(f"{where!r} lacks required field {exc.args[0]!r}") from exc
    except (TypeError, ValueError) as exc:
        raise ModelLoadError(f"{where!r} has a malformed field: {exc}") from exc


def iter_safetensors(paths: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of the given .safetensors files, derived tensors skipped."""
    from safetensors import safe_open

    for path in paths:
        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                for name in f.keys():
                    if name.endswith(_IGNORED_SUFFIXES):
                        continue
                    yield name, f.get_tensor(name)
        except ModelLoadError:
            raise
        except Exception as exc:  # SafetensorError, OSError on truncated files
            raise ModelLoadError(f"cannot read safetensors file {path!r}: {exc}") from exc


def safetensors_files(path: str) -> list[str]:
    """One .safetensors file, or every one in a folder (sorted)."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        return [path]
    if os.path.isdir(path):
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
        if files:
            return files
    raise ModelLoadError(f"{path!r} is neither a .safetensors file nor a folder holding some")


def load_hf_tokenizer(path: str, eos_token_ids=()) -> Tokenizer:
    """The transformers tokenizer saved in folder ``path``, wrapped (``eos_token_ids``: the model's as well)."""
    from transformers import AutoTokenizer

    try:
        hf_tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load the tokenizer of {path!r}: {exc}") from exc
    return Tokenizer(hf_tok, eos_token_ids=eos_token_ids)


# generation_config.json keys that set sampling defaults, and the SamplingParams field each sets (as vLLM maps them).
_GENERATION_KEYS = MappingProxyType({"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                                     "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                                     "max_new_tokens": "max_tokens"})


def generation_defaults(path: str) -> dict:
    """SamplingParams fields the model's ``generation_config.json`` sets ({} without one, or for a file).

    vLLM (``generation_config="auto"``, its default) uses these as the
    defaults of requests that bring no SamplingParams: the values the file
    states for temperature, top_p, top_k, min_p, repetition_penalty and
    max_new_tokens (as max_tokens). Keys set to null are left out. Values
    SamplingParams would refuse are a ModelLoadError now, not a failure of
    every later request.
    """
    file = os.path.join(path, "generation_config.json")
    if not os.path.isfile(file):
        return {}
    raw = _read_json(file)
    defaults = {field: raw[key] for key, field in _GENERATION_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**defaults)
    except InvalidRequestError as exc:
        raise ModelLoadError(f"{file!r} sets an invalid sampling default: {exc}") from exc
    return defaults


class HFFolderSource:
    """A transformers-style folder. Holds the config and the shard list; weights are read per call.

    ``read_weights=False`` (load_format="dummy") opens only the config and
    tokenizer, so a folder without weight files will do.
    """

    def __init__(self, path: str, read_weights: bool = True) -> None:
        self.path = path
        self.config = config_from_hf(_read_json(os.path.join(path, "config.json")), os.path.join(path, "config.json"))
        self._files = self._weight_files() if read_weights else []

    def _weight_files(self) -> list[str]:
        index = os.path.join(self.path, "model.safetensors.index.json")
        if os.path.isfile(index):
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise ModelLoadError(f"{index!r} has no weight_map")
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
        if not files:
            raise ModelLoadError(f"folder {self.path!r} holds no .safetensors weights")
        paths = [os.path.join(self.path, f) for f in files]
        for p in paths:
            if not os.path.isfile(p):
                raise ModelLoadError(f"weight shard {p!r} named by the index is missing")
        return paths

    def iter_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter_safetensors(self._files)

    def load_tokenizer(self) -> Tokenizer:
        return load_hf_tokenizer(self.path, self.config.eos_token_ids)
