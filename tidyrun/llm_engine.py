"""``llm.llm_engine``: the parts of vLLM's ``LLMEngine`` that callers of ``vllm.LLM`` reach for.

TRL's GRPO colocate mode syncs the trainer's weights with
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])``,
verl with ``...driver_worker.worker.model_runner.model.load_weights(weights)``;
OpenRLHF calls ``llm.llm_engine.reset_prefix_cache()``; lm-evaluation-harness
and many scripts read ``llm.llm_engine.model_config.max_model_len`` (and
``.dtype``), some ``cache_config.block_size`` or
``vllm_config.parallel_config.tensor_parallel_size``. Those are vLLM's
internals. tidyrun's own (the runner, the model, its tensors) are not handed
out: whoever kept one would keep device memory alive past ``shutdown()``.
Instead ``llm.llm_engine`` is this small read-only object: ``load_weights``
(= ``LLM.load_weights``) at the end of every step of that path,
``reset_prefix_cache``, ``get_tokenizer``, ``is_sleeping()``, and plain-value copies of the
configuration. It refers to the engine weakly, so keeping it keeps nothing
alive; anything else it is asked for is an AttributeError saying what it has.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from types import SimpleNamespace

import torch

from .errors import EngineShutdownError
from .sampling_params import SamplingParams


class WeightSyncPath:
    """``llm_engine``, ``model_executor``, ``driver_worker``, ``worker``, ``model_runner`` and ``model`` at once."""

    __slots__ = ("_llm",)

    def __init__(self, llm) -> None:
        self._llm = weakref.ref(llm)

    @property
    def model_executor(self) -> WeightSyncPath:
        return self

    driver_worker = worker = model_runner = model = model_executor

    def _engine(self):
        llm = self._llm()
        if llm is None or llm.is_shut_down:
            raise EngineShutdownError("the LLM this llm_engine belonged to is gone or shut down; create a new one")
        return llm

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``LLM.load_weights(weights)``; returns the names given, as vLLM's ``model.load_weights`` returns the
        names it loaded (verl logs how many)."""
        llm = self._engine()
        names: set[str] = set()

        def recorded():  # tensors pass one at a time, as the caller's iterable yields them
            for item in weights:
                if isinstance(item, tuple) and item and isinstance(item[0], str):
                    names.add(item[0])
                yield item

        llm.load_weights(recorded())
        return names

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """``LLM.reset_prefix_cache()``."""
        return self._engine().reset_prefix_cache(reset_running_requests, reset_connector)

    def get_tokenizer(self):
        """``LLM.get_tokenizer()``."""
        return self._engine().get_tokenizer()

    def is_sleeping(self) -> bool:
        """``LLM.is_sleeping`` (a method here, as on vLLM's engine)."""
        return self._engine().is_sleeping

    @property
    def tokenizer(self):
        return self.get_tokenizer()

    @property
    def model_config(self) -> SimpleNamespace:
        """A copy of vLLM's ``ModelConfig`` fields callers read: ``model``, ``max_model_len``, ``dtype``,
        ``seed``, ``max_logprobs``, ``logprobs_mode``, ``get_vocab_size()`` and
        ``get_diff_sampling_param()`` (the model's generation_config.json defaults)."""
        llm = self._engine()
        config, model = llm.config, llm.runner.model_config
        plain, defaults = vars(SamplingParams()), vars(llm.get_default_sampling_params())
        diff = {k: v for k, v in defaults.items() if not k.startswith("_") and plain.get(k) != v}
        return SimpleNamespace(
            model=config.model, tokenizer=config.tokenizer or config.model, max_model_len=llm.max_model_len,
            dtype=llm.dtype, seed=config.seed,
            max_logprobs=config.max_logprobs, logprobs_mode=config.logprobs_mode,
            get_vocab_size=lambda: model.vocab_size, get_diff_sampling_param=lambda: dict(diff),
            hf_config=_hf_config(model), architectures=[model.architecture])

    def get_model_config(self) -> SimpleNamespace:
        """``model_config`` (vLLM's engine method)."""
        return self.model_config

    @property
    def cache_config(self) -> SimpleNamespace:
        """``block_size`` and ``enable_prefix_caching``, as vLLM's ``CacheConfig`` names them."""
        config = self._engine().config
        return SimpleNamespace(block_size=config.cache.block_size, enable_prefix_caching=config.enable_prefix_caching)

    @property
    def vllm_config(self) -> SimpleNamespace:
        """``model_config``, ``cache_config``, ``parallel_config`` (``tensor_parallel_size``, ``world_size``) and
        ``scheduler_config`` (``max_num_seqs``, ``max_num_batched_tokens``, ``max_model_len``)."""
        llm = self._engine()
        config, tp = llm.config, llm.config.tensor_parallel_size
        return SimpleNamespace(
            model_config=self.model_config, cache_config=self.cache_config,
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, world_size=tp),
            scheduler_config=SimpleNamespace(max_num_seqs=config.max_num_seqs,
                                             max_num_batched_tokens=config.max_num_batched_tokens,
                                             max_model_len=llm.max_model_len))

    def __delattr__(self, name: str) -> None:
        """``del llm.llm_engine.model_executor.driver_worker``, the idiom vLLM users copy to free GPU memory
        before ``del llm``: nothing to do here (this object holds nothing; ``llm.shutdown()``, or dropping the
        LLM, gives every byte back)."""

    def __getattr__(self, name: str):
        raise AttributeError(
            f"llm.llm_engine has no {name!r}: tidyrun stands in for vLLM's engine with load_weights (at the end of "
            "model_executor.driver_worker.model_runner.model), reset_prefix_cache, get_tokenizer, is_sleeping, "
            "model_config (with hf_config), get_model_config, cache_config and vllm_config only; the LLM's own "
            "methods do the rest (the model and its tensors are not handed out: they would outlive shutdown)")


def _hf_config(model) -> SimpleNamespace:
    """The Hugging Face config fields callers read from ``model_config.hf_config``, under their HF names, as plain
    values (tidyrun's ModelConfig holds what it read from config.json or the GGUF header)."""
    eos = list(model.eos_token_ids)
    return SimpleNamespace(
        architectures=[model.architecture], vocab_size=model.vocab_size, hidden_size=model.hidden_size,
        intermediate_size=model.intermediate_size, num_hidden_layers=model.num_layers,
        num_attention_heads=model.num_heads, num_key_value_heads=model.num_kv_heads, head_dim=model.head_dim,
        rms_norm_eps=model.rms_norm_eps, rope_theta=model.rope_theta,
        max_position_embeddings=model.max_position_embeddings, tie_word_embeddings=model.tie_word_embeddings,
        bos_token_id=model.bos_token_id, eos_token_id=eos[0] if len(eos) == 1 else (eos or None))
