"""vLLM's ``LLM(...)`` keywords -> an EngineConfig, every one checked before any file is read.

Code written for ``vllm.LLM`` passes many keywords even at neutral values
(TRL's GRPO colocate mode: ``distributed_executor_backend``, ``model_impl``,
``enable_sleep_mode``, ``logprobs_mode``, ``quantization``; verl's rollout:
``load_format``, ``enable_chunked_prefill``, ``disable_custom_all_reduce``,
``skip_tokenizer_init``...). Porting must take only the import, so each is
accepted, and each either maps onto the EngineConfig (with vLLM's spellings
of its values: ``dtype="auto"``, ``seed=None``...) or has no meaning in
tidyrun. Those are accepted at the values where vLLM behaves as tidyrun
does, and refused otherwise with InvalidRequestError naming the keyword and
the value: silently ignoring ``quantization="awq"`` would run something the
caller did not ask for. All of it runs before the model is opened, so a
refused keyword costs nothing.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

import torch

from .config import CacheConfig, EngineConfig, SpeculativeConfig
from .errors import InvalidRequestError


class _Accepted(NamedTuple):
    ok: Callable[[Any], bool]
    values: str  # the accepted values, in words
    meaning: str  # why tidyrun needs nothing else (said when refusing)


def _bool(v) -> bool:
    return isinstance(v, bool)


def _bool_or_none(v) -> bool:
    return v is None or isinstance(v, bool)


def _one(v) -> bool:
    return v == 1 and not isinstance(v, bool)


def _positive_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 1


def _empty(v) -> bool:
    return v is None or (isinstance(v, dict) and not v)


# vLLM's structured-output backends; tidyrun's llguidance masks enforce the same constraints
_GRAMMAR_BACKENDS = ("auto", "xgrammar", "guidance", "llguidance")
_GRAMMAR_MEANING = ("tidyrun's structured outputs are llguidance's token masks, the same constraints as vLLM's "
                    "default backends")

# Keywords with no meaning in tidyrun: name -> the values accepted, and why those suffice.
NO_EFFECT: Mapping[str, _Accepted] = MappingProxyType({
    "trust_remote_code": _Accepted(_bool, "True or False",
                                   "tidyrun never runs code from the hub; it reads configs, weights and tokenizers"),
    "enable_sleep_mode": _Accepted(_bool, "True or False", "every tidyrun engine can sleep()"),
    "disable_log_stats": _Accepted(_bool, "True or False",
                                   "tidyrun logs no periodic statistics (llm.stats() returns them)"),
    "disable_custom_all_reduce": _Accepted(_bool, "True or False",
                                           "tidyrun's all-reduce is torch.distributed's (gloo / NCCL)"),
    "disable_mm_preprocessor_cache": _Accepted(_bool, "True or False", "tidyrun runs text-only models"),
    "swap_space": _Accepted(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                            "a number of GiB >= 0", "tidyrun preempts by recomputing and never swaps KV blocks"),
    "model_impl": _Accepted(lambda v: v in ("auto", "vllm"), "'auto' or 'vllm'",
                            "tidyrun runs its own Llama-family implementation"),
    "cpu_offload_gb": _Accepted(lambda v: v in (0, 0.0) and not isinstance(v, bool), "0",
                                "tidyrun keeps the weights on the device while running "
                                "(sleep(level=1) moves them to host memory between rollouts)"),
    "skip_tokenizer_init": _Accepted(lambda v: v is False, "False",
                                     "tidyrun detokenizes every output and checks stop strings, so it needs the "
                                     "tokenizer"),
    "tokenizer_mode": _Accepted(lambda v: v in ("auto", "hf"), "'auto' or 'hf'",
                                "tidyrun uses the model's Hugging Face tokenizer"),
    # False (vLLM: a prompt longer than max_num_batched_tokens is refused, shorter ones run whole) is a setting
    # of scheduling, not of results: tidyrun splits only prompts longer than max_num_batched_tokens.
    "enable_chunked_prefill": _Accepted(_bool_or_none, "None, True or False",
                                        "tidyrun splits prefills longer than max_num_batched_tokens and runs "
                                        "shorter ones whole, with the same results either way"),
    "hf_overrides": _Accepted(_empty, "None or {}", "tidyrun reads the model's config.json as it is"),
    "kv_cache_dtype": _Accepted(lambda v: v == "auto", "'auto'", "the KV cache is kept in the model's dtype"),
    "limit_mm_per_prompt": _Accepted(_empty, "None or {}", "tidyrun runs text-only models"),
    # lm-evaluation-harness always passes enable_lora=False with max_lora_rank; without LoRA the sizes mean nothing
    "enable_lora": _Accepted(lambda v: v is False or v is None, "False", "tidyrun serves no LoRA adapters"),
    "max_lora_rank": _Accepted(_positive_int, "an int >= 1", "tidyrun serves no LoRA adapters (enable_lora=False)"),
    "max_loras": _Accepted(_positive_int, "an int >= 1", "tidyrun serves no LoRA adapters (enable_lora=False)"),
    # every tidyrun engine generates and also embeds (llm.embed, llm.score by cosine similarity): "embed" /
    # "pooling" ask for nothing more; vLLM's classification and cross-encoder heads are not there
    "task": _Accepted(lambda v: v in ("auto", "generate", "embed"), "'auto', 'generate' or 'embed'",
                      "every tidyrun engine generates and embeds (llm.embed, llm.score); it has no classification "
                      "or cross-encoder heads"),
    "runner": _Accepted(lambda v: v in ("auto", "generate", "pooling"), "'auto', 'generate' or 'pooling'",
                        "every tidyrun engine generates and embeds (llm.embed, llm.score); it has no classification "
                        "or cross-encoder heads"),
    "worker_cls": _Accepted(lambda v: v == "auto", "'auto'", "tidyrun runs no vLLM workers"),
    # vLLM's engine arguments that its examples pass through from the command line (every one, at its default)
    # and that verl forwards from its config
    "pipeline_parallel_size": _Accepted(_one, "1",
                                        "tidyrun splits a model across GPUs by tensor parallelism only"),
    "data_parallel_size": _Accepted(_one, "1",
                                    "one LLM is one engine (build one per replica)"),
    "enable_expert_parallel": _Accepted(lambda v: v is False, "False",
                                        "tidyrun's MoE layers split experts by tensor parallelism"),
    "max_seq_len_to_capture": _Accepted(_positive_int, "an int >= 1",
                                        "tidyrun's CUDA graphs cover every context length (they are keyed by batch "
                                        "size only)"),
    "disable_cascade_attn": _Accepted(_bool, "True or False", "tidyrun has no cascade attention"),
    "disable_async_output_proc": _Accepted(_bool, "True or False",
                                           "outputs are built on the host while the next step runs "
                                           "(async_scheduling)"),
    "use_v2_block_manager": _Accepted(_bool, "True or False", "tidyrun has one block manager"),
    "use_tqdm_on_load": _Accepted(_bool, "True or False", "loading shows no progress bar"),
    "hf_token": _Accepted(lambda v: v is None or isinstance(v, (bool, str)), "None, a bool or a token",
                          "tidyrun downloads nothing: models come from local folders and the local Hugging Face "
                          "cache"),
    "served_model_name": _Accepted(lambda v: v is None or isinstance(v, (str, list)), "None, a name or names",
                                   "the OpenAI server takes its model name as `tidyrun serve --served-model-name`"),
    "mm_processor_kwargs": _Accepted(_empty, "None or {}", "tidyrun runs text-only models"),
    "allowed_local_media_path": _Accepted(lambda v: v in ("", None), "''", "tidyrun runs text-only models"),
    "enable_prompt_embeds": _Accepted(lambda v: v is False, "False", "prompts are text or token ids"),
    "logits_processors": _Accepted(lambda v: v is None or v == [], "None or []",
                                   "tidyrun runs no custom logits processors; SamplingParams' penalties, logit_bias, "
                                   "allowed_token_ids, bad_words and structured outputs run on the device"),
    "guided_decoding_backend": _Accepted(lambda v: v is None or v in _GRAMMAR_BACKENDS,
                                         "'auto', 'xgrammar' or 'guidance'", _GRAMMAR_MEANING),
    "structured_outputs_config": _Accepted(
        lambda v: _empty(v) or (isinstance(v, dict) and set(v) <= {"backend"}
                                and v.get("backend") in _GRAMMAR_BACKENDS),
        "None, {} or {'backend': 'auto' | 'xgrammar' | 'guidance'}", _GRAMMAR_MEANING),
    "scheduling_policy": _Accepted(lambda v: v == "fcfs", "'fcfs'", "tidyrun schedules first come, first served"),
    "preemption_mode": _Accepted(lambda v: v in (None, "recompute"), "None or 'recompute'",
                                 "tidyrun preempts by recomputing"),
    "disable_sliding_window": _Accepted(lambda v: v is False, "False",
                                        "sliding-window layers keep their window (turning it off changes the model)"),
    "override_generation_config": _Accepted(_empty, "None or {}",
                                            "generation defaults come from the model's generation_config.json "
                                            "(generation_config='auto') or vLLM's ('vllm')"),
    "kv_transfer_config": _Accepted(lambda v: v is None, "None", "tidyrun keeps each KV cache in its own engine"),
})

# Every keyword checked on its own, config or not (and that LLM(config=...) therefore does not count as a
# conflict): NO_EFFECT's, worker_extension_cls (the facade's: runner.rpc.load_extension) and profiler_config
# (the facade's: profiler.profiler_config).
CHECKED_APART = frozenset(NO_EFFECT) | {"worker_extension_cls", "profiler_config"}


def check_no_effect_options(options: Mapping[str, Any]) -> None:
    """Refuse a keyword of ``NO_EFFECT`` at a value tidyrun cannot honour."""
    for name, accepted in NO_EFFECT.items():
        value = options[name]
        if not accepted.ok(value):
            raise InvalidRequestError(f"LLM({name}={value!r}) is not supported: {accepted.meaning}; "
                                      f"pass {accepted.values} (or leave it out)")


def _alias(options: Mapping[str, Any], ours: str, theirs: str, default=None):
    """The value of an option that has tidyrun's name and vLLM's: either one, or both when they agree."""
    a, b = options[ours], options[theirs]
    if a is not default and b is not default and a != b:
        raise InvalidRequestError(f"{ours}={a!r} and {theirs}={b!r} are one option (tidyrun's and vLLM's name) "
                                  "with different values; pass one")
    return a if a is not default else b


def _dtype(value):
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    return None if value == "auto" else value


def _load_format(options: Mapping[str, Any]) -> str:
    load_format, quantization = options["load_format"], options["quantization"]
    if load_format == "pt":
        raise InvalidRequestError("LLM(load_format='pt') is not supported: tidyrun reads safetensors and GGUF "
                                  "files, not PyTorch .bin/.pt checkpoints; convert the checkpoint to safetensors")
    if quantization is None:
        return load_format
    if quantization != "gguf":
        raise InvalidRequestError(
            f"LLM(quantization={quantization!r}) is not supported: tidyrun runs unquantized weights (bf16/fp16/fp32; "
            "GGUF files are dequantized when loaded); pass None, or 'gguf' for a GGUF model")
    if load_format not in ("auto", "gguf"):
        raise InvalidRequestError(f"quantization='gguf' needs a GGUF model, but load_format={load_format!r}")
    return "gguf"


def _cuda_graph_sizes(options: Mapping[str, Any]):
    compilation = options["compilation_config"]
    if compilation is None:
        return options["cuda_graph_sizes"]
    if not isinstance(compilation, dict) or set(compilation) - {"cudagraph_capture_sizes"}:
        raise InvalidRequestError(
            f"LLM(compilation_config={compilation!r}) is not supported: tidyrun does not use torch.compile; "
            "it takes a dict with cudagraph_capture_sizes only (the same as cuda_graph_sizes)")
    sizes = compilation.get("cudagraph_capture_sizes")
    ours = options["cuda_graph_sizes"]
    if ours is not None and sizes is not None and list(ours) != list(sizes):
        raise InvalidRequestError(f"cuda_graph_sizes={ours!r} and compilation_config's cudagraph_capture_sizes="
                                  f"{sizes!r} are one option with different values; pass one")
    return ours if ours is not None else sizes


def _batch_invariant(value: bool | None) -> bool:
    """None: vLLM's switch, the environment variable VLLM_BATCH_INVARIANT ("1" on, "0" or unset off)."""
    if value is not None:
        return value
    env = os.environ.get("VLLM_BATCH_INVARIANT", "0")
    if env not in ("0", "1"):
        raise InvalidRequestError(f"VLLM_BATCH_INVARIANT must be '0' or '1', got {env!r}")
    return env == "1"


def engine_config(model: str | None, options: Mapping[str, Any]) -> EngineConfig:
    """The EngineConfig of ``LLM(model, **options)`` (every keyword of ``LLM.__init__`` but ``config``)."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

    def given(name: str):  # vLLM's None ("pick for me") -> tidyrun's default
        return defaults[name] if options[name] is None else options[name]

    tokenizer, tokenizer_revision = options["tokenizer"], options["tokenizer_revision"]
    if tokenizer is None and tokenizer_revision is not None:
        tokenizer = model  # vLLM: the model's own tokenizer, from another revision
    if tokenizer == model and tokenizer_revision in (None, options["revision"]):
        tokenizer = tokenizer_revision = None  # the model's own tokenizer, from its own files
    return EngineConfig(
        model=model, dtype=_dtype(options["dtype"]), device=options["device"], max_model_len=options["max_model_len"],
        max_num_seqs=given("max_num_seqs"), max_num_batched_tokens=given("max_num_batched_tokens"),
        seed=given("seed"), enable_prefix_caching=given("enable_prefix_caching"),
        speculative=SpeculativeConfig.from_value(_alias(options, "speculative", "speculative_config")),
        enforce_eager=given("enforce_eager"), cuda_graph_sizes=_cuda_graph_sizes(options),
        kernels=options["kernels"], batch_invariant=_batch_invariant(options["batch_invariant"]),
        async_scheduling=given("async_scheduling"),
        tensor_parallel_size=options["tensor_parallel_size"],
        distributed_executor_backend=options["distributed_executor_backend"],
        keep_host_buffers=options["keep_host_buffers"],
        cache=CacheConfig(block_size=options["block_size"],
                          num_blocks=_alias(options, "num_kv_blocks", "num_gpu_blocks_override"),
                          memory_bytes=_alias(options, "kv_cache_memory", "kv_cache_memory_bytes"),
                          gpu_memory_utilization=options["gpu_memory_utilization"]),
        max_logprobs=options["max_logprobs"], logprobs_mode=options["logprobs_mode"],
        revision=options["revision"], download_dir=options["download_dir"], load_format=_load_format(options),
        tokenizer=tokenizer, tokenizer_revision=tokenizer_revision,
        generation_config=options["generation_config"],
    )
