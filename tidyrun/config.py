"""Frozen configuration objects.

Configs describe what the user asked for and what the checkpoint declares.
They are never written to after construction: values derived at start-up (the
number of KV blocks, the resolved dtype) live in runner state, so one config
object can build many engines and always means the same thing.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from types import MappingProxyType

import torch


def _check_types(owner: str, ints: dict, reals: dict | None = None) -> None:
    """InvalidRequestError naming the first keyword whose value is not an int (None allowed) or, in
    ``reals``, not a real number: the range checks after this would otherwise fail with a bare
    TypeError comparing, say, the string "0.5" with 0."""
    from .errors import InvalidRequestError

    for name, value in ints.items():
        if value is not None and (not isinstance(value, numbers.Integral) or isinstance(value, bool)):
            raise InvalidRequestError(f"{name} must be an int, got {value!r} ({type(value).__name__}) in {owner}")
    for name, value in (reals or {}).items():
        if not isinstance(value, numbers.Real) or isinstance(value, bool):
            raise InvalidRequestError(f"{name} must be a number, got {value!r} ({type(value).__name__}) in {owner}")

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3", "mixtral", "qwen3_moe", "olmoe")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as declared by a checkpoint (HF ``rope_scaling``)."""

    rope_type: str  # "linear", "llama3", or "yarn" / "dynamic" / "longrope" (computed by transformers)
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    inv_freq: tuple[float, ...] = ()  # the inverse frequencies themselves, when transformers computed them
    attention_factor: float = 1.0  # cos and sin are scaled by it (yarn, longrope)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and numerics of a Llama-family checkpoint, whatever its file format."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over each query and key head before RoPE
    fused_checkpoint: bool = False  # Phi-3: the checkpoint stores qkv_proj and gate_up_proj already fused
    # Each layer's sliding window (0: global attention; () none windowed). Gemma 3: the RoPE base of its windowed
    # layers, and the query scaling's denominator (scores scaled by query_pre_attn_scalar ** -0.5, not head_dim's).
    sliding_windows: tuple[int, ...] = ()
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float | None = None
    rope_scaling: RopeScaling | None = None
    # Mixture of experts (Mixtral, Qwen3-MoE, OLMoE): each token's MLP is the weighted sum of the
    # ``num_experts_per_tok`` experts (of ``num_experts``, each a SwiGLU of ``moe_intermediate_size``) its router
    # scores highest; ``norm_topk_prob``: the chosen softmax weights are rescaled to sum to 1. ``dense_layers``
    # keep a dense MLP of ``intermediate_size`` (Qwen3-MoE's mlp_only_layers / decoder_sparse_step).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    dense_layers: tuple[int, ...] = ()
    # OLMoE: q_norm/k_norm span the whole query / key projection (all heads at once), not each head.
    qk_norm_whole: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        from .errors import UnsupportedModelError

        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {self.architecture!r} is not supported; "
                f"tidyrun runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                     "num_heads", "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise UnsupportedModelError(f"model config field {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise UnsupportedModelError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0):
            raise UnsupportedModelError(
                f"a mixture of experts needs 0 < num_experts_per_tok <= num_experts and moe_intermediate_size > 0, "
                f"got {self.num_experts_per_tok}, {self.num_experts}, {self.moe_intermediate_size}")
        if self.sliding_windows and (len(self.sliding_windows) != self.num_layers
                                     or any(w < 0 for w in self.sliding_windows)):
            raise UnsupportedModelError(f"sliding_windows needs one width >= 0 per layer ({self.num_layers}), "
                                        f"got {self.sliding_windows}")

    def is_moe_layer(self, layer: int) -> bool:
        return self.num_experts > 0 and layer not in self.dense_layers

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


@dataclass(frozen=True)
class CacheConfig:
    """How the paged KV cache is sized.

    ``num_blocks`` fixes the block count; otherwise it is derived from
    ``memory_bytes`` (vLLM's ``kv_cache_memory_bytes``; CPU default 1 GiB),
    or on CUDA from ``gpu_memory_utilization``: as in vLLM, the share of the
    whole device this engine may use, weights and activations included,
    what others hold not charged to it but required to be free
    (``runner.kv_plan.gpu_kv_budget``). Capped at what ``max_num_seqs`` full
    contexts need.
    """

    block_size: int = 16
    num_blocks: int | None = None
    memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9

    def __post_init__(self) -> None:
        from .errors import InvalidRequestError

        if self.block_size is None:  # vLLM's EngineArgs default: the platform's choice, which is 16 here
            object.__setattr__(self, "block_size", 16)
        _check_types("the KV cache's settings", dict(block_size=self.block_size, num_blocks=self.num_blocks,
                                                     memory_bytes=self.memory_bytes),
                     dict(gpu_memory_utilization=self.gpu_memory_utilization))
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise InvalidRequestError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise InvalidRequestError(f"memory_bytes must be positive, got {self.memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )


@dataclass(frozen=True)
class SpeculativeConfig:
    """n-gram prompt-lookup speculation: propose up to ``num_speculative_tokens`` tokens that followed
    the latest earlier occurrence of the last ``prompt_lookup_max``..``prompt_lookup_min`` tokens."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 3
    prompt_lookup_min: int = 1

    def __post_init__(self) -> None:
        from .errors import InvalidRequestError

        if self.method != "ngram":
            raise InvalidRequestError(f"speculative method {self.method!r} is not supported (only 'ngram')")
        if not 1 <= self.num_speculative_tokens <= 32:
            raise InvalidRequestError(f"num_speculative_tokens must be in [1, 32], got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise InvalidRequestError("need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                                      f"{self.prompt_lookup_min}, {self.prompt_lookup_max}")

    @classmethod
    def from_value(cls, value) -> SpeculativeConfig | None:
        from .errors import InvalidRequestError

        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"speculative must be a dict or SpeculativeConfig, got {type(value).__name__}")
        unknown = set(value) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
        if unknown:
            raise InvalidRequestError(f"unknown speculative options: {sorted(unknown)}")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine is built from. ``dtype``/``device`` of None mean "pick for me"."""

    model: str | None = None
    dtype: str | None = None
    device: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    seed: int = 0
    enable_prefix_caching: bool = True
    speculative: SpeculativeConfig | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    # GPU execution: "triton" kernels (default on CUDA) or the "torch" reference path (default elsewhere);
    # decode steps replayed as CUDA graphs of these batch sizes (None: a default set) unless enforce_eager.
    kernels: str | None = None
    enforce_eager: bool = False
    # Every row's result independent of what else shares the step (decode, prefill, chunked prefill, draft
    # verification): products with one reduction order for any number of rows (never cuBLAS) and attention
    # whose split of the keys depends on the sequence only. Costs speed (docs/BENCHMARKS.md); CUDA only.
    batch_invariant: bool = False
    # vLLM's async scheduling: the next decode step is launched before the host reads this step's tokens,
    # which it books while that step runs (pipeline.py); steps that need the host's view of their tokens
    # (penalties, grammars, logprobs beyond the one-pass logprobs=0) run as before. One rank, no
    # speculation. None (vLLM's default): on where it applies (a CUDA device, one rank, no speculation).
    async_scheduling: bool | None = None
    cuda_graph_sizes: tuple[int, ...] | None = None
    # Ranks the model is split over (one process each; rank 0 is this process). Checked against the model
    # (at most one rank per KV head) and the devices when the engine starts.
    tensor_parallel_size: int = 1
    # How the ranks start (vLLM's names): None or "mp", this engine spawns ranks 1..N-1 ("uni" too at one
    # rank); "external_launcher", the caller's launcher (torchrun) started one process per rank and each
    # builds its own engine (distributed/external.py). At one rank every backend is the in-process engine.
    distributed_executor_backend: str | None = None
    # Keep the pinned host copy of the weights between level-1 sleeps (allocated once, reused) instead of
    # freeing it at every wake; costs host memory the size of the weights while awake.
    keep_host_buffers: bool = True
    # Logprobs, as in vLLM: the most a request may ask for (-1: no limit), and whether they are taken from
    # the model's own distribution ("raw_logprobs") or the one sampled from ("processed_logprobs": after
    # penalties, bias, masks, temperature, top-k/p, min-p); the "*_logits" modes return logits instead.
    max_logprobs: int = 20
    logprobs_mode: str = "raw_logprobs"
    # Where the model comes from: ``model`` may be a Hugging Face id ("org/name"), found in the local cache
    # (``download_dir``, else HF_HUB_CACHE / HF_HOME) at ``revision``; nothing is downloaded. ``load_format``:
    # "auto" (what the files are), "safetensors" or "gguf" (insist on that), "dummy" (random weights of the
    # model's shapes, no weight file read: for callers that push their own weights next).
    revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"
    # A Hugging Face tokenizer (folder or cached id, at ``tokenizer_revision``) instead of the model's own.
    tokenizer: str | None = None
    tokenizer_revision: str | None = None
    # vLLM's ``generation_config``: "auto" takes the model's generation_config.json sampling defaults
    # (``LLM.get_default_sampling_params``), "vllm" leaves them out (SamplingParams' own defaults).
    generation_config: str = "auto"

    def overlaps_steps(self, device: torch.device) -> bool:
        """Whether steps are launched one ahead (pipeline.py): ``async_scheduling``, or where it is None, on a CUDA
        device with one rank and no speculation (measured faster there: docs/BENCHMARKS.md)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return device.type == "cuda" and self.tensor_parallel_size == 1 and self.speculative is None

    def __post_init__(self) -> None:
        from .errors import InvalidRequestError

        if self.load_format not in LOAD_FORMATS:
            raise InvalidRequestError(f"load_format must be one of {list(LOAD_FORMATS)}, got {self.load_format!r}")
        for name in ("revision", "download_dir", "tokenizer", "tokenizer_revision"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise InvalidRequestError(f"{name} must be a str or None, got {getattr(self, name)!r}")
        if self.tokenizer_revision is not None and self.tokenizer is None:
            raise InvalidRequestError("tokenizer_revision needs a tokenizer (a Hugging Face id) to apply to")

        if self.generation_config not in ("auto", "vllm"):
            raise InvalidRequestError(f"generation_config must be 'auto' (the model's generation_config.json) or "
                                      f"'vllm' (SamplingParams' defaults), got {self.generation_config!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            raise InvalidRequestError(f"logprobs_mode must be one of {list(LOGPROBS_MODES)}, got {self.logprobs_mode!r}")
        if not isinstance(self.max_logprobs, int) or isinstance(self.max_logprobs, bool) or self.max_logprobs < -1:
            raise InvalidRequestError(f"max_logprobs must be -1 (no limit) or an int >= 0, got {self.max_logprobs!r}")

        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise InvalidRequestError(f"tensor_parallel_size must be an int >= 1, got {tp!r}")

        backend = self.distributed_executor_backend
        allowed = EXECUTOR_BACKENDS if tp == 1 else MULTI_RANK_BACKENDS
        if backend not in allowed:
            raise InvalidRequestError(
                f"distributed_executor_backend={backend!r} is not supported with tensor_parallel_size={tp}: "
                f"pass one of {list(allowed)}")

        if self.kernels not in (None, "torch", "triton"):
            raise InvalidRequestError(f"kernels must be 'torch', 'triton' or None, got {self.kernels!r}")
        for name in ("enforce_eager", "keep_host_buffers", "batch_invariant", "async_scheduling"):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (name == "async_scheduling" and value is None):
                raise InvalidRequestError(f"{name} must be a bool, got {value!r}")
        if self.batch_invariant and tp > 1:
            raise InvalidRequestError("batch_invariant=True is not available with tensor_parallel_size > 1: "
                                      "the all-reduce's order over rows is not verified (docs/BENCHMARKS.md)")
        if self.async_scheduling and (tp > 1 or self.speculative is not None):
            raise InvalidRequestError("async_scheduling=True is not available with "
                                      + ("tensor_parallel_size > 1" if tp > 1 else "speculative decoding")
                                      + " yet: pass async_scheduling=False")
        if self.cuda_graph_sizes is not None:
            sizes = self.cuda_graph_sizes
            if (not isinstance(sizes, (list, tuple)) or not sizes
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes)):
                raise InvalidRequestError(f"cuda_graph_sizes must be a non-empty list of positive ints, got {sizes!r}")
            object.__setattr__(self, "cuda_graph_sizes", tuple(sorted(set(sizes))))

        _check_types("the engine's settings", dict(max_model_len=self.max_model_len, max_num_seqs=self.max_num_seqs,
                                                   max_num_batched_tokens=self.max_num_batched_tokens, seed=self.seed))
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise InvalidRequestError(f"max_model_len must be > 1, got {self.max_model_len}")
        if self.max_num_seqs <= 0:
            raise InvalidRequestError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise InvalidRequestError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )


LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# vLLM's distributed_executor_backend values tidyrun runs: any at one rank (one rank is always in-process);
# above one, ranks this engine spawns (None, "mp") or ranks the caller's launcher started.
EXECUTOR_BACKENDS = (None, "mp", "uni", "external_launcher")
MULTI_RANK_BACKENDS = (None, "mp", "external_launcher")

LOGPROBS_MODES = ("raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits")

DTYPES = MappingProxyType({
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
})


@dataclass(frozen=True)
class ProfilerConfig:
    """``LLM(profiler_config=)``: vLLM's ``ProfilerConfig`` keys (``profiler.py`` runs it). ``profiler`` None:
    profiling off (``start_profile`` refuses)."""

    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True
    delay_iterations: int = 0  # vLLM's step-count window: not supported here, accepted at 0 only
    max_iterations: int = 0

    def __post_init__(self) -> None:
        from .errors import InvalidRequestError

        profilers = ("torch", "cuda")
        if self.profiler not in (None, *profilers):
            raise InvalidRequestError(f"profiler_config profiler={self.profiler!r}: use one of {profilers} (or None)")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise InvalidRequestError("profiler_config profiler='torch' needs torch_profiler_dir, the folder the "
                                      "traces are written to")
        for name in ("delay_iterations", "max_iterations"):
            if getattr(self, name) != 0:
                raise InvalidRequestError(f"profiler_config {name}={getattr(self, name)!r} is not supported: tidyrun "
                                          "traces from start_profile() to stop_profile(); leave it 0")
