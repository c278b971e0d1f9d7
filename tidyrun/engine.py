"""LLM: the user-facing engine (generate, chat, stream, shutdown).

One engine = one model source, one tokenizer, one ModelRunner (all device
state) and one Scheduler (host state). Nothing here is shared between
engines, so several can live in one process.

The facade routes: requests are checked by ``RequestIntake``, batches are
formed and their results booked by the ``Scheduler``, steps run on the
``ModelRunner``; it keeps only the request table and the finished outputs
not yet handed out. vLLM's constructor keywords are translated (and the
ones with no effect here checked) by engine_args.py.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import random
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

from .beam_search import BeamSearchOutput, beam_search
from .config import EngineConfig, SpeculativeConfig
from .distributed.driver import TPDriverRunner
from .distributed.external import LaunchedRankRunner, join_launch
from .engine_args import CHECKED_APART, check_no_effect_options, engine_config
from .errors import EngineShutdownError, InvalidRequestError
from .intake import (Prompt, PromptType, RequestIntake, check_no_priority, check_pooling_task, check_text_only,
                     legacy_token_prompts, no_head, pooling_normalize, score_pairs)
from .kv_cache import BlockPool
from .llm_engine import WeightSyncPath
from .loader import generation_defaults, open_engine_source, open_engine_tokenizer
from .logprobs import FlatLogprobs, add_records
from .metrics_reader import Metric, metrics_from_stats
from .outputs import (CompletionOutput, EmbeddingRequestOutput, PoolingRequestOutput, RequestOutput,
                      ScoringRequestOutput, embedding_outputs, pooling_outputs, scoring_outputs)
from .pipeline import StepPipeline
from .pooling_params import PoolingParams
from .profiler import Profile, profiler_config as parse_profiler_config
from .report import ShutdownReport
from .resources import drop_traceback_locals
from .runner import ModelRunner
from .runner.rpc import ApplyModel, call_on_rank, check_rpc_method, load_extension
from .sampling_params import BeamSearchParams, SamplingParams
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, streamable_length
from .spec_decode import NgramProposer
from .structured import GrammarCompiler


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    # Logprob dicts already built, by sequence index, and the prompt's once complete: a stream asks for the
    # output after every step, and rebuilding (and decoding) every entry each time would be quadratic.
    _sample_dicts: dict[int, list] = field(default_factory=dict)
    _prompt_dicts: list | None = None

    def output(self, decode) -> RequestOutput:
        """The request's output so far; ``decode(token id)`` gives a logprob entry's text."""
        decode = decode if self.seqs[0].params.detokenize else _no_text
        outs = [CompletionOutput(s.index, s.text, s.output_token_ids,
                                 s.cumulative_logprob if s.logprobs is not None else None,
                                 self._logprob_dicts(s, decode), s.finish_reason, s.stop_reason) for s in self.seqs]
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids),
                             self._prompt_logprob_dicts(decode), outs, self.num_cached_tokens)

    def _logprob_dicts(self, seq: Sequence, decode) -> list | FlatLogprobs | None:
        if seq.logprobs is None:
            return None
        built = self._sample_dicts.get(seq.index)
        if built is None:
            built = self._sample_dicts[seq.index] = FlatLogprobs() if seq.params.flat_logprobs else []
        add_records(built, seq.logprobs[len(built):], decode)
        return built[:]

    def _prompt_logprob_dicts(self, decode) -> list | FlatLogprobs | None:
        first = self.seqs[0]  # every sample has the same prompt: the first one's
        records = first.prompt_logprobs
        if records is None:
            return None
        if self._prompt_dicts is not None:
            return self._prompt_dicts[:]
        dicts = FlatLogprobs() if first.params.flat_logprobs else []
        add_records(dicts, records, decode)
        if all(r is not None for r in records[1:]):  # complete: never changes again
            self._prompt_dicts = dicts
        return dicts[:]

    @property
    def num_cached_tokens(self) -> int:
        return self.seqs[0].num_cached_tokens

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


def _no_text(token_id: int) -> None:
    return None


@dataclass
class EngineShutdownReport(ShutdownReport):
    """The runner's shutdown report plus the requests that were aborted by it, and every rank's own report."""

    aborted: list[RequestOutput] = field(default_factory=list)  # in-flight requests it aborted
    unclaimed: list[RequestOutput] = field(default_factory=list)  # finished outputs nobody had collected
    ranks: list[ShutdownReport] = field(default_factory=list)  # by tensor-parallel rank; [0] is this process

    @property
    def clean(self) -> bool:
        return super().clean and all(r.clean for r in self.ranks)


def _shutdown_at_exit(runner: ModelRunner) -> None:
    runner.shutdown()


def _drops_frames_on_error(method):
    """Clear the locals of tidyrun's frames in an exception escaping ``method`` (the user's frames keep theirs).

    An exception raised mid-forward (Ctrl-C, a failing kernel) holds the
    frames it went through; theirs hold the model (a module's ``self``), the KV
    cache and activations. Whoever keeps the exception (an ``except ... as
    e``, a debugger, ``sys.last_exc``) would keep that memory alive, and
    shutdown would trace each surviving tensor back to an unwound frame.
    """

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except BaseException as exc:
            drop_traceback_locals(exc, user_frames=False)
            raise

    return wrapper


def _check_no_options_besides(config: EngineConfig, model: str | None, options: dict) -> None:
    """``LLM(config=...)`` takes every option from the config: refuse others rather than ignore them.

    The keywords that have no effect in tidyrun (``engine_args.CHECKED_APART``)
    are checked on their own, config or not.
    """
    defaults = inspect.signature(LLM.__init__).parameters
    conflicts = [f"{name}={value!r}" for name, value in options.items()
                 if name not in CHECKED_APART and value != defaults[name].default]
    if model is not None and model != config.model:
        conflicts.insert(0, f"model={model!r} (the config says {config.model!r})")
    if conflicts:
        raise InvalidRequestError(
            f"LLM(config=...) takes every option from the config, but also got {', '.join(conflicts)}; "
            "set them in the config (dataclasses.replace(config, ...)) or leave config out")


def _check_no_lora(lora_request) -> None:
    if lora_request is not None:
        raise InvalidRequestError(f"lora_request={lora_request!r} is not supported: tidyrun has no LoRA adapters; "
                                  "pass None (or merge the adapter into the weights and load_weights() them)")


class LLM:
    """Generate text from a Llama-family model in this process; vLLM's ``vllm.LLM``, keyword for keyword.

    ``model`` is a GGUF file, a folder with one GGUF file, a Hugging Face
    folder, or a Hugging Face id ("org/name") already in the local cache
    (``download_dir``, else HF_HUB_CACHE / HF_HOME; at ``revision``; tidyrun
    never downloads); None means the bundled SmolLM2-135M-Instruct.
    ``device``/``dtype`` default to the accelerator in bf16 if there is one,
    else the CPU in fp32 (``dtype="auto"`` or None; also a torch.dtype).
    ``keep_host_buffers`` keeps the pinned host copy of the weights between
    level-1 sleeps (allocated once, reused; costs host memory the size of the
    weights while awake). On CUDA, decode steps run as CUDA graphs captured
    at start-up for ``cuda_graph_sizes`` (default 1, 2, 4, 8, 16, 32, ... up
    to min(256, max_num_seqs, max_num_batched_tokens); vLLM's
    ``compilation_config={"cudagraph_capture_sizes": [...]}`` says the same);
    ``enforce_eager=True`` turns them off.
    ``kernels`` picks "triton" (the CUDA default) or the "torch" reference path.
    ``batch_invariant=True`` (CUDA) makes every row's result independent of
    what else shares the step: greedy output batched equals alone and
    speculation on equals off, bit for bit, at a cost in speed
    (docs/BENCHMARKS.md); dense models on one rank (refused for mixtures of
    experts and ``tensor_parallel_size > 1``, not verified there). None:
    vLLM's switch, the environment variable ``VLLM_BATCH_INVARIANT=1``, else off.
    ``async_scheduling=True`` (vLLM's option) launches each plain decode step
    before the host has read the previous step's tokens, so booking them,
    scheduling and staging overlap the device's work (pipeline.py); the
    tokens are the same. Steps that need their tokens on the host first
    (penalties, grammars, logprobs other than an RL rollout's one-pass
    ``logprobs=0``) run as before; refused with speculation
    and ``tensor_parallel_size > 1``. None (vLLM's default): on for a CUDA
    device with one rank and no speculation, else off. False: off.
    ``tensor_parallel_size=N`` splits the model over N ranks: this process
    is rank 0 and spawns N - 1 worker processes (one per further GPU on
    CUDA, gloo on the CPU; a script needs ``if __name__ == "__main__"``);
    ``shutdown()`` stops them and reports each rank. With
    ``distributed_executor_backend="external_launcher"`` the caller's
    launcher (torchrun, one process per rank, on one node or several)
    started the ranks instead: every process builds its own LLM and makes
    the same calls (generate with the same prompts and params, sleep,
    wake_up, load_weights) and gets the same outputs; each N consecutive
    ranks form one engine, on the launcher's store and a process group of
    the engine's own (the default group stays the caller's), or on
    ``process_group``, a ``torch.distributed`` group the caller built.
    ``config``: an ``EngineConfig`` instead of the keyword options (passing
    both is refused with InvalidRequestError naming the options).

    vLLM's keywords, as vLLM means them: ``max_num_seqs`` /
    ``max_num_batched_tokens`` / ``seed`` / ``enable_prefix_caching`` (None:
    the default), ``kv_cache_memory_bytes`` (= ``kv_cache_memory``),
    ``speculative_config`` (= ``speculative``), ``max_logprobs``,
    ``logprobs_mode`` ("raw_logprobs", "processed_logprobs", "raw_logits",
    "processed_logits"), ``load_format`` ("auto", "safetensors", "gguf", or
    "dummy": random weights of the model's shapes, for callers that push
    their own next), ``quantization`` (None, or "gguf" for a GGUF model:
    tidyrun runs dequantized weights), ``tokenizer`` / ``tokenizer_revision``
    (a Hugging Face tokenizer instead of the model's). Keywords that mean
    nothing here are accepted where vLLM would behave as tidyrun does and
    refused (InvalidRequestError naming the keyword) elsewhere:
    ``trust_remote_code`` (either: tidyrun never runs code from the hub),
    ``enable_sleep_mode`` (either: every engine can sleep),
    ``disable_log_stats``, ``disable_custom_all_reduce``,
    ``disable_mm_preprocessor_cache`` (either), ``swap_space`` (any: tidyrun
    never swaps), ``model_impl`` ("auto"/"vllm"), ``cpu_offload_gb`` (0),
    ``skip_tokenizer_init`` (False), ``tokenizer_mode`` ("auto"/"hf"),
    ``enable_chunked_prefill`` (None/True: prefills are always chunked),
    ``hf_overrides`` / ``limit_mm_per_prompt`` (None/{}), ``kv_cache_dtype``
    ("auto"), ``distributed_executor_backend`` (None, "mp",
    "external_launcher"; at one rank also "uni"; every backend at one rank is
    the in-process engine, which is what TRL's colocate mode asks for).
    An unknown keyword is a TypeError, as for any function.
    """

    def __init__(self, model: str | None = None, *, dtype: str | torch.dtype | None = None, device: str | None = None,
                 max_model_len: int | None = None, max_num_seqs: int | None = 256,
                 max_num_batched_tokens: int | None = 8192, block_size: int = 16, num_kv_blocks: int | None = None,
                 kv_cache_memory: int | None = None, gpu_memory_utilization: float = 0.9, seed: int | None = 0,
                 keep_host_buffers: bool = True, enable_prefix_caching: bool | None = True,
                 speculative: dict | SpeculativeConfig | None = None, enforce_eager: bool | None = False,
                 cuda_graph_sizes: list[int] | None = None, kernels: str | None = None,
                 batch_invariant: bool | None = None, async_scheduling: bool | None = None,
                 tensor_parallel_size: int = 1,
                 # vLLM's names and options (engine_args.py says what each does here)
                 kv_cache_memory_bytes: int | None = None, speculative_config: dict | None = None,
                 compilation_config: dict | None = None, max_logprobs: int = 20,
                 logprobs_mode: str = "raw_logprobs", quantization: str | None = None, load_format: str = "auto",
                 revision: str | None = None, download_dir: str | None = None, tokenizer: str | None = None,
                 tokenizer_revision: str | None = None, distributed_executor_backend: str | None = None,
                 trust_remote_code: bool = False, enable_sleep_mode: bool = False, disable_log_stats: bool = True,
                 disable_custom_all_reduce: bool = False, disable_mm_preprocessor_cache: bool = False,
                 swap_space: float = 4, model_impl: str = "auto", cpu_offload_gb: float = 0,
                 skip_tokenizer_init: bool = False, tokenizer_mode: str = "auto",
                 enable_chunked_prefill: bool | None = None, hf_overrides: dict | None = None,
                 kv_cache_dtype: str = "auto", limit_mm_per_prompt: dict | None = None,
                 enable_lora: bool = False, max_lora_rank: int = 16, max_loras: int = 1, task: str = "auto",
                 runner: str = "auto", worker_cls: str = "auto", worker_extension_cls: str = "",
                 generation_config: str = "auto", pipeline_parallel_size: int = 1, data_parallel_size: int = 1,
                 enable_expert_parallel: bool = False, max_seq_len_to_capture: int = 8192,
                 disable_cascade_attn: bool = False, disable_async_output_proc: bool = False,
                 use_v2_block_manager: bool = True, use_tqdm_on_load: bool = True, hf_token: bool | str | None = None,
                 served_model_name: str | list[str] | None = None, mm_processor_kwargs: dict | None = None,
                 allowed_local_media_path: str = "", enable_prompt_embeds: bool = False,
                 logits_processors: list | None = None, guided_decoding_backend: str | None = None,
                 structured_outputs_config: dict | None = None, scheduling_policy: str = "fcfs",
                 preemption_mode: str | None = None, disable_sliding_window: bool = False,
                 override_generation_config: dict | None = None, kv_transfer_config=None,
                 num_gpu_blocks_override: int | None = None, profiler_config: dict | None = None,
                 config: EngineConfig | None = None, process_group=None) -> None:
        # The keyword options, taken before any other local exists: every one, however many are added.
        options = {k: v for k, v in locals().items() if k not in ("self", "model", "config", "process_group")}
        self._closed = True  # until construction succeeds; makes shutdown() safe on a failed start
        self.runner: ModelRunner | None = None
        # Every keyword is checked before any file is opened.
        check_no_effect_options(options)
        self._extension = load_extension(worker_extension_cls)  # collective_rpc's names beyond RPC_METHODS
        self._profiler_config = parse_profiler_config(profiler_config)  # start_profile()'s (None: refused)
        self._profile: Profile | None = None
        if config is None:
            config = engine_config(model, options)
        else:
            _check_no_options_besides(config, model, options)
        launched = config.tensor_parallel_size > 1 and config.distributed_executor_backend == "external_launcher"
        if process_group is not None and not launched:
            raise InvalidRequestError("process_group is the group of ranks an external launcher started: it needs "
                                      "tensor_parallel_size > 1 and distributed_executor_backend='external_launcher'")
        self.config = config
        self._report: EngineShutdownReport | None = None
        # Ranks a launcher started find each other before the model is opened: whatever fails on one rank
        # from here on is told to the others instead of leaving them waiting.
        rank = join_launch(config, process_group) if launched else None
        try:
            self.source = open_engine_source(config)
            self.tokenizer = open_engine_tokenizer(config, self.source)
            sampling_defaults = MappingProxyType(  # checked before the runner
                generation_defaults(self.source.path) if config.generation_config == "auto" else {})
            if rank is not None:
                self.runner = LaunchedRankRunner(self.source, rank, self.tokenizer.eos_token_ids)
            else:
                runner_class = ModelRunner if config.tensor_parallel_size == 1 else TPDriverRunner
                self.runner = runner_class(self.source, config, self.tokenizer.eos_token_ids)
        except BaseException as exc:
            if rank is not None:
                rank.fail(exc)
            drop_traceback_locals(exc)  # the runner already released what it took
            raise
        # Shut the runner down if this engine is garbage-collected or the interpreter exits first.
        self._finalizer = weakref.finalize(self, _shutdown_at_exit, self.runner)
        self.scheduler = Scheduler(BlockPool(self.runner.num_kv_blocks, config.enable_prefix_caching),
                                   self.runner.block_size, config.max_num_seqs, config.max_num_batched_tokens,
                                   propose=self._proposer(config.speculative))
        self._intake = RequestIntake(self.tokenizer, self.runner.model_config.vocab_size, self.runner.max_model_len,
                                     max_logprobs=config.max_logprobs, sampling_defaults=sampling_defaults)
        # Structured outputs: grammars compiled per constraint (cached), a matcher per sequence; the library's
        # view of the vocabulary is built on the first structured request only.
        self._grammars = GrammarCompiler(self.tokenizer, self.runner.model_config.vocab_size,
                                         self.tokenizer.eos_token_ids)
        # Steps: schedule → run → book; with async_scheduling, plain steps launched one ahead (pipeline.py).
        self._pipeline = StepPipeline(self.scheduler, self.runner, self.tokenizer.eos_token_ids,
                                      config.overlaps_steps(self.runner.device))
        self._requests: dict[str, _Request] = {}
        # Finished outputs not yet handed out; step() returns them, so none is ever dropped.
        self._pending_outputs: list[RequestOutput] = []
        self._request_counter = itertools.count()
        self._seq_counter = itertools.count()
        self._seed_rng = random.Random(config.seed)  # seeds for requests that bring none
        self._closed = False

    def _proposer(self, spec: SpeculativeConfig | None):
        if spec is None:
            return None
        ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min)
        max_len = self.runner.max_model_len

        def propose(seq: Sequence, limit: int) -> list[int]:
            return ngram.propose(seq.token_ids, min(limit, max_len - seq.num_tokens - 1))

        return propose

    # -- properties --------------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        self._check_alive()
        return self.runner.max_model_len

    @property
    def device(self):
        self._check_alive()
        return self.runner.device

    @property
    def dtype(self):
        self._check_alive()
        return self.runner.dtype

    def get_tokenizer(self):
        """The model's transformers tokenizer (``encode``, ``decode``, ``apply_chat_template``, ``eos_token_id``),
        as vLLM's ``get_tokenizer()`` returns it. Token ids it makes are what ``generate`` takes."""
        self._check_alive()
        return self.tokenizer.hf_tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A new SamplingParams of the defaults ``generate``/``chat`` use when given none: SamplingParams()
        with what the model's generation_config.json sets (temperature, top_p, top_k, min_p,
        repetition_penalty, max_new_tokens as max_tokens), as vLLM does with its default generation_config="auto"."""
        self._check_alive()
        return self._intake.default_params()

    @property
    def is_shut_down(self) -> bool:
        return self._closed

    @property
    def is_sleeping(self) -> bool:
        """Whether anything ``sleep`` released is still released (vLLM's meaning).

        False once every tag is woken, even while weights discarded by a
        level-2 sleep wait to be pushed; ``generate`` then raises
        WeightsNotLoadedError naming how many are missing.
        """
        self._check_alive()
        return bool(self.runner.sleeping)

    # -- sleep / wake / weights --------------------------------------------------------

    def _check_idle(self, what: str) -> None:
        n = len(self._requests)
        if n:
            raise InvalidRequestError(f"cannot {what} with {n} request(s) in flight; let them finish or abort them")
        self._pipeline.drain()  # nothing is left launched (async scheduling drops such steps already)

    @_drops_frames_on_error
    def sleep(self, level: int = 1) -> dict[str, int]:
        """Give device memory back between rollouts; returns the bytes released by owner.

        Level 1 copies the weights to pinned host memory (one copy) and frees
        every device buffer; level 2 discards the weights too: waking them
        only allocates their memory, and the trainer's weights are pushed
        with ``update_weights`` (or the checkpoint read again with
        ``collective_rpc("reload_weights")``). While asleep, generation raises
        EngineSleepingError rather than silently re-allocating memory a
        trainer may be using; call ``wake_up()`` first. Partly woken
        (``wake_up(["weights"])``), a further sleep releases what is awake at
        ``level`` and keeps the rest as it sleeps; fully asleep, it is
        refused with InvalidRequestError.
        """
        self._check_alive()
        self._check_idle("sleep")
        freed = self.runner.sleep(level)
        self.scheduler.pool.reset_prefix_cache()  # the KV cache is gone
        return freed

    @_drops_frames_on_error
    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep released: everything, or only ``["weights"]`` / ``["kv_cache"]``.

        Weights slept at level 1 come back as they were; at level 2 they come
        back allocated but empty (no checkpoint read): generating raises
        WeightsNotLoadedError until every weight is pushed with
        ``update_weights`` (or reloaded).
        """
        self._check_alive()
        self.runner.wake_up(tags)

    @_drops_frames_on_error
    def update_weights(self, weights) -> int:
        """Load new weights in place from a state dict or an iterable of (HF name, tensor).

        Names, shapes and dtypes are checked (a dict before anything is
        copied); unknown names are rejected with InvalidRequestError. Works
        while awake (any subset, in as many calls as wanted: after a level-2
        wake the model runs again once every weight has been pushed), or
        while the weights sleep at level 2 (then all of them are needed, and
        they wake with these). Returns the number of tensors loaded.
        """
        self._check_alive()
        self._check_idle("update weights")
        try:
            return self.runner.update_weights(weights)
        finally:
            self.scheduler.pool.reset_prefix_cache()  # cached keys/values came from the old weights

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> int:
        """vLLM's ``model.load_weights``: load (HF name, tensor) pairs in place; returns how many were loaded.

        The same as ``update_weights`` (names, shapes and dtypes checked;
        refused while requests are in flight; the prefix cache reset). TRL
        pushes one tensor at a time this way, through ``llm_engine``.
        """
        return self.update_weights(weights)

    @_drops_frames_on_error
    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                       kwargs: dict | None = None) -> list:
        """vLLM's ``collective_rpc``: run ``method`` on every rank's runner; returns the results by rank ([0]: here).

        ``method`` is "reload_weights" (re-read the weights from the model
        source), "load_weights" (``kwargs={"weights": pairs}``, as
        ``load_weights``), the name of a method of ``worker_extension_cls``, or
        a function; either of the last two is called as ``method(worker, *args,
        **kwargs)`` with each rank's ``runner.rpc.RankWorker``, as vLLM calls it
        with its worker: ``worker.model_runner.model``, ``worker.rank``,
        ``worker.device``, what earlier calls set on it, and the runner's own
        methods (with tensor_parallel_size > 1 it is pickled to the worker
        processes: a module-level function or class).
        After the named methods the prefix cache is reset; after a function
        that changes weights, call ``reset_prefix_cache()`` (as with vLLM).
        A function may push weights with ``worker.model_runner.model.load_weights(pairs)``
        (vLLM's spelling) or ``worker.update_weights(pairs)``: either way the
        runner counts them as loaded (after ``sleep(level=2)`` it generates
        again once every weight is back), and while the weights sleep either is
        refused with EngineSleepingError.
        ``timeout`` must be None: the ranks answer within the collective
        timeout or fail.
        """
        self._check_alive()
        method = check_rpc_method(method, self._extension)
        if timeout is not None:
            raise InvalidRequestError(f"collective_rpc(timeout={timeout!r}) is not supported: calls run to the end "
                                      "(a tensor-parallel rank that stops answering fails them); pass None")
        args, kwargs = tuple(args), dict(kwargs or {})
        if callable(method):
            return self._on_ranks(method, args, kwargs)
        self._check_idle(f"run {method}")
        try:
            return self._on_ranks(method, args, kwargs)
        finally:
            self.scheduler.pool.reset_prefix_cache()  # cached keys/values came from the old weights

    def apply_model(self, func) -> list:
        """vLLM's ``apply_model``: ``func(model)`` on every rank's model (tidyrun's module: its parameters,
        ``load_weights(pairs)``); the results by rank. As with ``collective_rpc``, call
        ``reset_prefix_cache()`` after changing weights this way."""
        self._check_alive()
        if not callable(func):
            raise InvalidRequestError(f"apply_model needs a function of the model, got {type(func).__name__}")
        return self._on_ranks(ApplyModel(func), (), {})

    def _on_ranks(self, method, args: tuple, kwargs: dict) -> list:
        if self.config.tensor_parallel_size > 1:
            return self.runner.collective_rpc(method, args, kwargs)
        return [call_on_rank(self.runner, method, args, kwargs)]

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prefix; False (and nothing forgotten) while requests are in flight, as in vLLM,
        unless ``reset_running_requests``: then those requests are preempted first (their blocks freed; each
        recomputes its prompt and tokens so far when next scheduled, with the weights of that moment) and
        True. ``reset_connector``: vLLM's KV connector; tidyrun has none, so there is nothing more to reset.

        Weight updates through tidyrun reset it by themselves; call this
        after changing weights behind its back (a ``collective_rpc`` function).
        """
        self._check_alive()
        if self._requests and not reset_running_requests:
            return False
        self._collect_finished(self._pipeline.drain())  # the step in flight booked before its blocks go
        self.scheduler.preempt_running()
        self.scheduler.pool.reset_prefix_cache()
        return True

    @property
    def llm_engine(self) -> WeightSyncPath:
        """A small read-only stand-in for vLLM's engine: the weight-push path, the prefix cache, the tokenizer and
        copies of the configuration (see llm_engine.py)."""
        self._check_alive()
        return WeightSyncPath(self)

    def ledger_report(self) -> str:
        """Table of the device memory this engine holds, by owner."""
        self._check_alive()
        return self.runner.ledger.report()

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start tracing what this engine runs (vLLM's ``start_profile``), as ``LLM(profiler_config=)`` or
        ``VLLM_TORCH_PROFILER_DIR`` says (profiler.py); ``profile_prefix`` names the trace file (default
        "tidyrun"). InvalidRequestError without a profiler, or while a span is open."""
        self._check_alive()
        if self._profile is not None:
            raise InvalidRequestError("start_profile(): a profile is already running; call stop_profile() first")
        self._profile = Profile(self._profiler_config, self.runner.device, profile_prefix)

    def stop_profile(self) -> str | None:
        """End the span ``start_profile`` began; returns the trace's path (None for the "cuda" profiler)."""
        self._check_alive()
        if self._profile is None:
            raise InvalidRequestError("stop_profile(): no profile is running; call start_profile() first")
        return self._end_profile()

    def _end_profile(self) -> str | None:
        profile, self._profile = self._profile, None
        return profile.stop()

    # -- requests ----------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineShutdownError("this LLM has been shut down; create a new one")

    def add_request(self, prompt: PromptType, params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Queue a request; it runs on the following ``step()`` calls. Returns its id."""
        self._check_alive()
        self.runner.check_awake()
        return self._enqueue(*self._intake.request(prompt, params), request_id)

    def _enqueue(self, prompt: Prompt, params: SamplingParams, request_id: str | None = None) -> str:
        """Queue a request that passed intake: give it an id and its sequences (one per sample)."""
        if request_id is None:
            request_id = str(next(self._request_counter))
            while request_id in self._requests:  # a caller-chosen id may have taken this one
                request_id = str(next(self._request_counter))
        request_id = str(request_id)
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        seqs = []
        for i in range(params.n):
            gen = None
            if not params.greedy:
                seed = (params.seed + i) % 2**63 if params.seed is not None else self._seed_rng.getrandbits(62)
                gen = self.runner.make_generator(seed)
            grammar = None if params.structured_outputs is None else self._grammars.new_state(params.structured_outputs)
            seqs.append(Sequence(next(self._seq_counter), request_id, i, prompt.token_ids, params, self.tokenizer, gen,
                                 grammar))
        self._requests[request_id] = _Request(request_id, prompt.text, prompt.token_ids, seqs)
        for seq in seqs:
            self.scheduler.add(seq)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request now; its sequences finish with finish_reason "abort" and free their blocks.

        Its output (tokens so far) is returned by the next ``step()``.
        """
        self._check_alive()
        self.scheduler.abort(request_id)
        self._pipeline.settle()  # a step launched ahead for its sequences alone is not kept
        self._collect_finished()

    def has_unfinished_requests(self) -> bool:
        """True while requests run or finished outputs wait to be returned by ``step()``."""
        return self.scheduler.has_unfinished() or bool(self._pending_outputs)

    @_drops_frames_on_error
    def step(self) -> list[RequestOutput]:
        """Run one scheduler step; returns the outputs of requests that finished (or were aborted) since the last."""
        self._check_alive()
        try:
            finished = self._pipeline.step()  # requests with a sequence that finished in this step
        except BaseException:
            self._collect_finished()  # the failing step's requests were aborted: their outputs come next
            raise
        # The running sequences' next grammar masks, filled on the compiler's thread while this step's
        # outputs are collected and the next one is scheduled and launched (GrammarCompiler.fill_later
        # says why). Waiting ones are left out: a deep queue would refill their first masks every step.
        # With a step in flight (async scheduling) the states still wait for its tokens: nothing to fill yet.
        grammars = [s.grammar for s in self.scheduler.running if s.grammar is not None] if self._pipeline.idle else []
        if grammars:
            self._grammars.fill_ahead(grammars)
        self._collect_finished(finished)
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def request_output(self, request_id: str) -> RequestOutput | None:
        """The output so far of a request still in flight (None once finished and collected)."""
        self._check_alive()
        request = self._requests.get(request_id)
        return None if request is None else request.output(self._decode_token)

    def stats(self, memory: bool = True) -> dict:
        """Queue, KV-cache and memory figures for monitoring (host-side state only).

        ``memory=False`` leaves out ``device_memory_bytes``, a walk over the
        resource ledger (~0.5 ms with a 1.2B model's tensors): those figures
        change only at lifecycle transitions, so a loop that reads the rest
        after every step (the server's) refreshes them only then.
        """
        self._check_alive()
        scheduler = self.scheduler
        pool = scheduler.pool
        return {
            "waiting": len(scheduler.waiting),
            "running": len(scheduler.running),
            "kv_blocks_total": pool.num_blocks,
            "kv_blocks_used": pool.num_blocks - pool.num_free,
            "preemptions": scheduler.num_preemptions,
            "prefix_cached_tokens": scheduler.num_prefix_cached_tokens,
            "prefill_tokens": scheduler.num_prefill_tokens,
            "spec_draft_tokens": scheduler.num_spec_draft_tokens,
            "spec_accepted_tokens": scheduler.num_spec_accepted_tokens,
            "sleeping": bool(self.runner.sleeping),
        } | ({"device_memory_bytes": self.runner.ledger.bytes_by_owner()} if memory else {})

    def get_metrics(self) -> list[Metric]:
        """vLLM's ``get_metrics()``: counters and gauges by their ``vllm:`` names (prefix-cache queries and
        hits in tokens, queue sizes, preemptions, speculation, KV-cache usage), read now."""
        return metrics_from_stats(self.stats(), self.config.model or "default")

    def _decode_token(self, token_id: int) -> str:
        """One token's text, as a logprob entry shows it (special tokens included, as in vLLM)."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _collect_finished(self, request_ids: set[str] | None = None) -> None:
        """Move finished requests' outputs to the pending list: those of ``request_ids``, or all of them."""
        candidates = self._requests.values() if request_ids is None else (
            self._requests[i] for i in request_ids if i in self._requests)
        for r in [r for r in candidates if r.finished]:
            del self._requests[r.request_id]
            self._pending_outputs.append(r.output(self._decode_token))

    # -- batch API ---------------------------------------------------------------------

    @_drops_frames_on_error
    def generate(self, prompts: PromptType | Iterable[PromptType] | None = None,
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True, lora_request=None, priority: list[int] | None = None, *,
                 prompt_token_ids: list[int] | list[list[int]] | None = None) -> list[RequestOutput]:
        """Generate completions for one prompt or a list; outputs come back in prompt order.

        ``sampling_params`` None: ``get_default_sampling_params()``. ``lora_request`` must be None (no LoRA);
        ``priority`` None or all 0 (requests run first come, first served, as in vLLM's default scheduler).
        ``prompt_token_ids`` (vLLM's older keyword, instead of ``prompts``): one list of token ids or a list
        of them.
        """
        _check_no_lora(lora_request)
        check_no_priority(priority)
        self._check_alive()
        self.runner.check_awake()
        prompts = legacy_token_prompts(prompts, prompt_token_ids)
        requests = self._intake.requests(prompts, sampling_params)  # all checked before any is queued
        check_no_priority(priority, len(requests))
        ids: list[str] = []
        try:
            for prompt, params in requests:
                ids.append(self._enqueue(prompt, params))
        except BaseException:  # all or nothing: withdraw what this call already queued
            for request_id in ids:
                self.scheduler.abort(request_id)
            self._collect_finished()
            self._pending_outputs = [o for o in self._pending_outputs if o.request_id not in ids]
            raise
        return self._run_until_done(ids, use_tqdm)

    def _run_until_done(self, ids: list[str], use_tqdm) -> list[RequestOutput]:
        """Step until the requests ``ids`` finish. ``use_tqdm``: True (a tqdm bar, which tqdm's TQDM_*
        environment settings such as TQDM_DISABLE=1 still govern, as in vLLM), False, or a callable
        used in tqdm's place (vLLM accepts one)."""
        from tqdm.auto import tqdm

        results: dict[str, RequestOutput] = {}
        others: list[RequestOutput] = []  # requests queued by add_request(): keep theirs for step()
        wanted = set(ids)
        bar_type = use_tqdm if callable(use_tqdm) else tqdm
        bar_options = {} if use_tqdm else {"disable": True}
        try:
            with bar_type(total=len(ids), desc="Processed prompts", unit="req", **bar_options) as bar:
                while wanted - results.keys():
                    for out in self.step():
                        if out.request_id in wanted:
                            results[out.request_id] = out
                            bar.update(1)
                        else:
                            others.append(out)
        finally:
            self._pending_outputs[:0] = others
        return [results[i] for i in ids]

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, lora_request=None, chat_template: str | None = None,
             chat_template_content_format: str = "auto", add_generation_prompt: bool = True,
             continue_final_message: bool = False, tools: list[dict] | None = None,
             chat_template_kwargs: dict | None = None, mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with vLLM's arguments in vLLM's order.

        ``chat_template`` replaces the model's template (a jinja2 string);
        ``add_generation_prompt`` / ``continue_final_message`` (open the last
        message for the model to continue; needs add_generation_prompt=False),
        ``tools`` and ``chat_template_kwargs`` (further template variables,
        e.g. ``enable_thinking``) go to the template as transformers takes
        them. A message's content is a string, None or a list of OpenAI text
        parts; ``chat_template_content_format`` "auto" / "string" render it
        as a string (parts joined by newlines), "openai" as the list of parts.
        ``lora_request`` must be None (no LoRA); ``mm_processor_kwargs`` None
        or {} (text-only models).
        """
        _check_no_lora(lora_request)
        check_text_only(mm_processor_kwargs)
        self._check_alive()
        prompts = self._intake.conversations(
            messages, add_generation_prompt, continue_final_message=continue_final_message,
            chat_template=chat_template, tools=tools, template_kwargs=chat_template_kwargs,
            content_format=chat_template_content_format)
        return self.generate(prompts, sampling_params, use_tqdm)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the text of one completion as it is generated (n must be 1)."""
        self._check_alive()
        self.runner.check_awake()
        # Checked once: add_request() would check (and copy) the params again.
        tokenized, params = self._intake.stream_request(prompt, sampling_params)
        request_id = self._enqueue(tokenized, params)
        seq = self._requests[request_id].seqs[0]
        sent = 0
        others: list[RequestOutput] = []  # requests queued by add_request(): keep theirs for step()
        try:
            while not seq.is_finished:  # a shutdown in between finishes it with "abort"
                others += [o for o in self.step() if o.request_id != request_id]
                visible = max(sent, streamable_length(seq.text, params.stop, seq.is_finished))
                if visible > sent:
                    yield seq.text[sent:visible]
                    sent = visible
        except BaseException as exc:  # not a decorator: this is a generator
            drop_traceback_locals(exc, user_frames=False)
            raise
        finally:
            if not seq.is_finished and not self._closed:
                # The caller closed its own stream: abort it and do not queue an output nobody wants.
                self.abort_request(request_id)
            self._pending_outputs = [o for o in others + self._pending_outputs if o.request_id != request_id]

    @_drops_frames_on_error
    def beam_search(self, prompts: PromptType | list[PromptType], params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False, concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search (beam_search.py): one BeamSearchOutput per prompt, its ``params.beam_width`` best
        beams (``.sequences``: ``tokens`` prompt and generated, ``text``, ``cum_logprob``, ``logprobs``).
        ``use_tqdm`` and ``concurrency_limit`` are accepted (every prompt's beams run together)."""
        _check_no_lora(lora_request)
        self._check_alive()
        token_lists = self._intake.beam_prompts(prompts, params)
        hf = self.tokenizer.hf_tokenizer
        return beam_search(lambda batch, step: self.generate(batch, step, use_tqdm=False), token_lists, params,
                           hf.eos_token_id, self.max_model_len, hf.decode)

    @_drops_frames_on_error
    def embed(self, prompts: PromptType | list[PromptType], *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool = True, pooling_params: PoolingParams | None = None, lora_request=None,
              pooling: str = "last", normalize: bool | None = None) -> list[EmbeddingRequestOutput]:
        """vLLM's ``embed``: one EmbeddingRequestOutput per input (``.outputs.embedding``, a list of floats) from
        the final hidden states, through a KV-free path (no KV block is used).

        tidyrun's keywords: ``pooling`` "last" token (the usual choice for
        decoder models), "mean" over tokens, or "cls" (first token);
        ``normalize`` (or ``pooling_params.normalize``; default True).
        ``use_tqdm`` is accepted and shows nothing (one batched pass).
        """
        unit = pooling_normalize(pooling_params, normalize)
        token_lists, vectors = self._pooled(prompts, truncate_prompt_tokens, pooling, unit, lora_request)
        return embedding_outputs(f"embd-{next(self._seq_counter)}", token_lists, vectors)

    @_drops_frames_on_error
    def encode(self, prompts: PromptType | list[PromptType], pooling_params: PoolingParams | None = None, *,
               truncate_prompt_tokens: int | None = None, use_tqdm: bool = True, lora_request=None,
               pooling_task: str | None = None, tokenization_kwargs: dict | None = None,
               pooling: str = "last") -> list[PoolingRequestOutput]:
        """vLLM's ``encode``: one PoolingRequestOutput per input (``.outputs.data``, a float32 tensor), for
        ``pooling_task`` "embed" (or None): ``embed``'s vectors. Other tasks (classify, score, token_embed,
        token_classify, reward) need heads or per-token outputs tidyrun does not have: InvalidRequestError."""
        check_pooling_task(pooling_task, tokenization_kwargs)
        unit = pooling_normalize(pooling_params, None)
        token_lists, vectors = self._pooled(prompts, truncate_prompt_tokens, pooling, unit, lora_request)
        return pooling_outputs(f"pool-{next(self._seq_counter)}", token_lists, vectors)

    def classify(self, prompts, *args, **kwargs):
        """vLLM's ``classify``: refused (InvalidRequestError): tidyrun's models have no classification head."""
        raise InvalidRequestError(no_head("llm.classify"))

    def reward(self, prompts, *args, **kwargs):
        """vLLM's ``reward``: refused (InvalidRequestError): tidyrun's models have no reward head."""
        raise InvalidRequestError(no_head("llm.reward"))

    @_drops_frames_on_error
    def score(self, data_1: PromptType | list[PromptType], data_2: PromptType | list[PromptType], *,
              truncate_prompt_tokens: int | None = None, use_tqdm: bool = True,
              pooling_params: PoolingParams | None = None, lora_request=None,
              pooling: str = "last") -> list[ScoringRequestOutput]:
        """vLLM's ``score`` for an embedding model: the cosine similarity of each pair (``.outputs.score``),
        ``data_1`` against each of ``data_2`` (1:N) or two lists of one length item by item (N:N)."""
        pooling_normalize(pooling_params, None)  # checked; a cosine similarity is the same either way
        inputs, pairs = score_pairs(data_1, data_2)
        token_lists, vectors = self._pooled(inputs, truncate_prompt_tokens, pooling, True, lora_request)
        pad = self.tokenizer.hf_tokenizer.pad_token_id
        return scoring_outputs(f"score-{next(self._seq_counter)}", token_lists, vectors, pairs,
                               [] if pad is None else [pad])

    def _pooled(self, inputs, truncate: int | None, pooling: str, unit: bool, lora_request
                ) -> tuple[list[list[int]], torch.Tensor]:
        """``embed`` and ``score``'s one way to the runner's KV-free pooling: the inputs' token ids and their
        pooled rows [N, hidden]."""
        _check_no_lora(lora_request)
        self._check_alive()
        self.runner.check_awake()
        token_lists = self._intake.embed_inputs(inputs, truncate)
        return token_lists, self.runner.embed(token_lists, pooling, unit, self.config.max_num_batched_tokens)

    @_drops_frames_on_error
    def compute_logits(self, prompt: PromptType):
        """Float32 logits [num_tokens, vocab] at every position of ``prompt`` (a scoring primitive)."""
        self._check_alive()
        self.runner.check_awake()
        ids = self._intake.prompt(prompt).token_ids
        seq = Sequence(next(self._seq_counter), "__logits__", 0, ids, SamplingParams(), self.tokenizer, None)
        pool = self.scheduler.pool
        seq.block_table = pool.allocate(-(-len(ids) // self.runner.block_size))
        try:
            return self.runner.all_logits(ScheduledBatch([seq], [len(ids)]))
        finally:
            pool.free(seq.block_table)

    # -- lifecycle ---------------------------------------------------------------------

    def shutdown(self, strict: bool = False) -> EngineShutdownReport:
        """Abort in-flight requests, release every device resource and verify nothing survived.

        Idempotent; returns the report of the first call. ``strict=True``
        raises ResourceLeakError if a tensor outlived the runner (the report
        names the chain of references holding it).
        """
        if self._report is not None:
            return self._report
        if self.runner is None:  # construction failed before the runner existed
            self._report = EngineShutdownReport()
            return self._report
        self._closed = True
        for request_id in list(self._requests):
            self.scheduler.abort(request_id)
        self._pipeline.drain()  # a step launched ahead holds its tokens on the device until booked
        if self._profile is not None:  # a span still open: its trace is written now (host only)
            self._end_profile()
        self._collect_finished()
        outputs, self._pending_outputs = self._pending_outputs, []
        aborted = [o for o in outputs if any(c.finish_reason == "abort" for c in o.outputs)]
        unclaimed = [o for o in outputs if o not in aborted]
        self._grammars.close()  # its mask thread (host only; no step runs now)
        self._finalizer.detach()
        runner, self.runner = self.runner, None
        try:
            runner.shutdown(strict=strict)
        except BaseException as exc:
            failure = f"shutdown failed: {type(exc).__name__}: {exc}"
            raise
        else:
            failure = None
        finally:
            # Kept even when shutdown raises, so a later call reports the same survivors; a shutdown that
            # broke off before its report says so instead of passing for clean.
            report = runner.shutdown_report or ShutdownReport(errors=[failure or "shutdown did not complete"])
            self._report = EngineShutdownReport(report.released_bytes, report.survivors, report.seconds,
                                                report.errors, aborted=aborted, unclaimed=unclaimed,
                                                ranks=runner.rank_reports())
            del runner, report
        return self._report

    close = shutdown

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            # Ctrl-C mid-generate: the interrupted call's frames still hold the model. Clear tidyrun's
            # (the user's keep theirs) so that shutdown finds nothing alive, at once.
            drop_traceback_locals(exc, user_frames=False)
        self.shutdown()
