"""ModelRunner: builds the model and KV cache on a device and runs scheduled batches.

All device and pinned host memory is held by the rows of one ordered table
(``self.lifecycle``, see lifecycle.py and components.py), in acquisition
order:

    weights        the model's parameters, one WeightArena buffer
    host_weights   the pinned host copy a level-1 sleep keeps
    rope           the RoPE cos/sin tables
    kv_cache       the paged KV cache (sized by a KVPlan made before the model exists)
    process_group  this rank's communicators (tensor parallelism only)
    inputs         the step-input buffers (Triton path)
    cuda_graphs    the captured decode steps and their memory pool (Triton path, unless eager)

Start, ``sleep``, ``wake_up``, the level-2 refill of ``update_weights`` and
``reload_weights``, failure rollback and ``shutdown`` are loops over that
table; shutdown then proves, through the ledger's weak references, that
nothing survived, and names whoever holds what did.

As one rank of a tensor-parallel engine (``tp``), the runner holds only its
slice of the weights and KV heads and its group's communicators. The same
code runs the driver (rank 0, which samples) and the workers (forward only,
see ``forward_logits``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import warnings
from typing import NamedTuple

import numpy as np
import torch

from ..attention import ForwardContext
from ..audit import trace_survivors
from ..config import EngineConfig, ModelConfig
from ..device_copy import to_device
from ..errors import (EngineShutdownError, EngineSleepingError, InvalidRequestError, ModelLoadError,
                      ResourceLeakError, WeightsNotLoadedError)
from ..loader import ModelSource
from ..model.llama import LlamaForCausalLM
from ..model.registry import model_class
from ..model.ops import TorchOps, TritonOps
from ..model.sharding import TPShard
from ..report import ShutdownReport
from ..resources import ResourceLedger, drop_traceback_locals, free_device_caches
from ..logits_process import process_logits, stop_token_bans
from ..sampling import Sampler, logprob_records, pack_records, unpack_records
from ..scheduler import ScheduledBatch
from ..sequence import (NO_TOP, PromptLogprobRecords, SampledTokens, Sequence, StepOutput, TokenLogprob,
                        deferrable, draw_steps, launchable)
from ..spec_decode import accept_greedy, verify_drafts
from ..structured import PendingMasks
from .components import CudaGraphsRow, HostWeights, KVCacheRow, ProcessGroupRow, Rope, StepInputsRow, Weights
from .cuda_graphs import CudaGraphManager, default_capture_sizes
from .device import hopper_or_later, resolve_device, resolve_dtype, synchronize
from .input_batch import HostBatch, HostTokens, InputBatch, PromptRows, StepInputs, build_reference_batch, host_batch
from .kv_plan import plan_kv_cache
from .lifecycle import SLEEP_TAGS, WEIGHTS, Component, Lifecycle
from .pooling import POOLING_METHODS, chunks_by_tokens, dense_batch, normalize, pool

logger = logging.getLogger("tidyrun")


def _name_tensor_pairs(items):
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidRequestError(f"update_weights: expected (name, tensor) pairs, got {type(item).__name__}")
        yield item


class StepLogits(NamedTuple):
    """A step's logits (model dtype) of the rows that sample, and their argmax and its log-probability when
    the CUDA graph took them."""
    logits: torch.Tensor
    greedy: torch.Tensor | None
    greedy_logprob: torch.Tensor | None = None


class LaunchedStep(NamedTuple):
    """A step launched without waiting for it (async scheduling): row i of ``tokens`` (int64, on the
    device) is the token of ``seqs[i]``, row i of ``records`` (float64 token, log-probability, rank;
    None when no sequence asked for logprobs) its ``logprobs=0`` record; ``host`` is their copy on its way
    to the host (None: none started). Launched with ``defer=True``, only its forward pass runs: ``logits``
    holds the rows to sample and ``tokens`` is None until ``ModelRunner.sample_launched``."""
    batch: ScheduledBatch
    seqs: list[Sequence]
    tokens: torch.Tensor | None
    records: torch.Tensor | None
    host: HostTokens | None
    logits: StepLogits | None = None


def _with_records(seqs: list[Sequence], records: list[list[float]]) -> list[SampledTokens]:
    """One token per sequence from its (token, raw log-probability, rank) row, with its ``logprobs=0``
    record for the sequences that asked."""
    return [SampledTokens(s, [int(t)], None if s.params.logprobs is None else [(int(t), v, int(r), NO_TOP, NO_TOP)])
            for s, (t, v, r) in zip(seqs, records)]


class ModelRunner:
    accepts_rank_slices = False  # pushed weights must be full tensors (a launched rank also takes its slice)

    def __init__(self, source: ModelSource, config: EngineConfig, eos_token_ids: frozenset[int], tp=None) -> None:
        """``tp``: a ``distributed.rank.TPRank`` (its shard, group and block-count agreement) or None."""
        self.ledger = ResourceLedger()
        self.closed = False
        self.shutdown_report: ShutdownReport | None = None
        self.source, self.config, self.eos_token_ids = source, config, eos_token_ids
        self.tp_group = tp.group if tp is not None else None
        self.model_config: ModelConfig = source.config
        self.shard = tp.shard if tp is not None else TPShard.of(source.config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.cache.block_size
        self.ctx = ForwardContext()
        self.ops = self._choose_ops(config)
        self.sampler = Sampler(self.ops.race_sample, keyed=self.ops.keyed_race)
        self.rpc_worker = None  # collective_rpc's RankWorker (rpc.call_on_rank), made on first use
        self.graph_sizes = self._graph_sizes(config)
        self.last_transfer: dict[str, float] = {}
        gpu_memory = torch.cuda.mem_get_info(self.device) if self.device.type == "cuda" else None
        self.kv_plan = plan_kv_cache(self.model_config, self.shard, config, self.dtype, gpu_memory)
        self.max_model_len = self.kv_plan.max_model_len  # fixed before the model exists, never changed
        self.lifecycle = Lifecycle(self._components(tp))
        try:
            self.lifecycle.start()
        except BaseException as exc:
            # Give back what was taken before re-raising: the half-built model must not stay
            # alive through the frames of the traceback the caller is about to hold.
            drop_traceback_locals(exc)
            self.shutdown()
            raise
        self.startup_seconds = dict(self.lifecycle.seconds)
        logger.info("model runner ready on %s (%s kernels): %s; KV cache of %d blocks; %s", self.device,
                    self.ops.name, ", ".join(f"{k} {v:.2f} s" for k, v in self.startup_seconds.items()),
                    self.num_kv_blocks, self._graph_summary())

    def _components(self, tp) -> list[Component]:
        """The lifecycle table: every owner of device or pinned host memory, in acquisition order."""
        mc, cfg = self.model_config, self.config
        self.weights = Weights(self._build_model, self.source, self.device, self.dtype, self.ledger,
                               self.accepts_rank_slices)
        self.host_weights = HostWeights(self.weights, cfg.keep_host_buffers, self.ledger)
        self.kv = KVCacheRow(self.kv_plan, (mc.num_layers, self.block_size, self.shard.num_kv_heads, mc.head_dim),
                             self.dtype, self.device, self.ledger, tp.agree_num_blocks if tp is not None else None)
        table: list[Component] = [self.weights, self.host_weights, Rope(self.weights, self.ledger), self.kv]
        if tp is not None:
            table.append(ProcessGroupRow(tp.group, self.shard.rank, self.device, self.ledger, tp.before_connect))
        self.step_inputs = self.cuda_graphs = None
        if isinstance(self.ops, TritonOps):
            self.step_inputs = StepInputsRow(self._make_step_inputs)
            table.append(self.step_inputs)
            if self.graph_sizes is not None:
                self.cuda_graphs = CudaGraphsRow(self.graph_sizes, self.weights, self.kv, self.step_inputs,
                                                 self.ctx, self.ledger)
                table.append(self.cuda_graphs)
        return table

    def _build_model(self) -> LlamaForCausalLM:
        """The model skeleton on the meta device; the weights row places its parameters."""
        return model_class(self.model_config)(self.model_config, self.max_model_len, self.ctx, self.dtype, self.ops,
                                              self.shard, self.tp_group)

    def _make_step_inputs(self) -> StepInputs:
        mc, cfg = self.model_config, self.config
        # compute_logits() sends a whole prompt (up to max_model_len tokens) through one step.
        return StepInputs(self.block_size, mc.num_heads // mc.num_kv_heads, self.shard.num_kv_heads,
                          max(cfg.max_num_batched_tokens, self.max_model_len), cfg.max_num_seqs,
                          -(-self.max_model_len // self.block_size), self.device, self.ledger,
                          batch_invariant=cfg.batch_invariant, mask_words=(mc.vocab_size + 31) // 32)

    # -- what the rows hold (None while released) -----------------------------------------

    @property
    def model(self) -> LlamaForCausalLM | None:
        return self.weights.model

    @property
    def arena(self):
        return self.weights.arena

    @property
    def kv_cache(self):
        return self.kv.cache

    @property
    def num_kv_blocks(self) -> int:
        return self.kv.num_blocks

    @property
    def inputs(self) -> StepInputs | None:
        return None if self.step_inputs is None else self.step_inputs.inputs

    @property
    def graphs(self) -> CudaGraphManager | None:
        return None if self.cuda_graphs is None else self.cuda_graphs.graphs

    @property
    def sleeping(self) -> set[str]:
        """The sleep tags whose components are released ("weights", "kv_cache")."""
        return self.lifecycle.sleeping_tags

    @property
    def sleep_level(self) -> int | None:
        return self.lifecycle.level

    def _choose_ops(self, config: EngineConfig) -> TorchOps:
        kernels = config.kernels or ("triton" if self.device.type == "cuda" else "torch")
        if kernels == "triton" and self.device.type != "cuda":
            raise InvalidRequestError("kernels='triton' needs a CUDA device; the CPU runs kernels='torch'")
        if config.batch_invariant and self.model_config.num_experts:
            raise InvalidRequestError("batch_invariant=True is not available for mixture-of-experts models: the "
                                      "expert kernel's invariance is not verified (docs/BENCHMARKS.md)")
        if config.batch_invariant and kernels != "triton":
            raise InvalidRequestError("batch_invariant=True needs the Triton kernels (a CUDA device): the torch "
                                      "path's products are the BLAS library's, whose order depends on the rows")
        if kernels == "torch":
            return TorchOps()
        hopper = hopper_or_later(self.device)
        return TritonOps(torch.cuda.get_device_properties(self.device).multi_processor_count, self.ctx,
                         batch_invariant=config.batch_invariant, pdl=hopper, tma=hopper)

    def _graph_summary(self) -> str:
        graphs = self.graphs
        if graphs is None:
            return "no CUDA graphs"
        return (f"{len(graphs.keys)} CUDA graphs ({graphs.sizes}: batch sizes by tokens per sequence) "
                f"captured in {graphs.capture_seconds:.2f} s, pool {graphs.pool_bytes / 2**20:.0f} MiB")

    def _graph_sizes(self, config: EngineConfig) -> dict[int, tuple[int, ...]] | None:
        """Batch sizes to capture by tokens per sequence (1: decode; k + 1: verifying up to k drafts),
        or None when steps run eagerly. A step never holds more sequences than ``max_num_seqs`` nor
        more tokens than ``max_num_batched_tokens``."""
        if (config.enforce_eager or not isinstance(self.ops, TritonOps) or self.device.type != "cuda"
                or self.shard.world > 1):  # collectives are not captured: tensor-parallel steps run eagerly
            return None
        cap = min(config.max_num_seqs, config.max_num_batched_tokens)
        if config.cuda_graph_sizes is None:
            sizes = {1: default_capture_sizes(cap)}
        else:
            too_big = [n for n in config.cuda_graph_sizes if n > cap]
            if too_big:
                raise InvalidRequestError(
                    f"cuda_graph_sizes {too_big} exceed what one decode step can hold: min(max_num_seqs="
                    f"{config.max_num_seqs}, max_num_batched_tokens={config.max_num_batched_tokens}) = {cap}")
            sizes = {1: config.cuda_graph_sizes}
        if config.speculative is not None:
            q = config.speculative.num_speculative_tokens + 1
            verify = tuple(n for n in sizes[1] if n * q <= config.max_num_batched_tokens)
            if verify:
                sizes[q] = verify
        return sizes

    def _check_alive(self) -> None:
        if self.closed:
            raise EngineShutdownError("the model runner has been shut down")

    def check_awake(self) -> None:
        """The choke point of everything that runs the model: asleep, or weights not (all) loaded, raise."""
        self._check_alive()
        if self.sleeping:
            raise EngineSleepingError(
                f"the engine is asleep (level {self.sleep_level}; released: {', '.join(sorted(self.sleeping))}); "
                "call wake_up() first")
        missing = self.weights.status.missing  # runs every step: the set itself, not a copy
        if missing:
            raise WeightsNotLoadedError(
                f"{len(missing)} of the {len(self.weights.names)} weight tensors are not loaded (e.g. "
                f"{min(missing)!r}): the weights were discarded by sleep(level=2) and woken without loading; "
                "push them with load_weights()/update_weights() or call collective_rpc('reload_weights')")

    @property
    def missing_weights(self) -> list[str]:
        """HF names of the weights the model cannot run without: discarded by sleep(level=2), not pushed since."""
        return sorted(self.weights.missing)

    # -- sleep / wake / weight updates ---------------------------------------------------

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Release device memory: level 1 keeps the weights in pinned host memory, level 2 discards them.

        Returns the device bytes released, by ledger owner. Partly asleep
        (``wake_up(["weights"])`` after a sleep), it puts what is awake to
        sleep at ``level`` and leaves the rest at its own level (see
        lifecycle.py); with nothing awake it is refused. A sleep that fails
        (no pinned memory for the host copy) leaves awake what was awake.
        """
        self._check_alive()
        if level not in (1, 2) or isinstance(level, bool):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
        if self.lifecycle.fully_asleep:
            raise InvalidRequestError(f"the engine is already asleep (level {self.sleep_level}): nothing is awake to "
                                      "release; call wake_up() first")
        weights_sleep = WEIGHTS not in self.sleeping
        synchronize(self.device)
        before = self.ledger.bytes_by_owner()
        start = time.perf_counter()
        self.lifecycle.sleep(level)
        after = self.ledger.bytes_by_owner()
        if any(after.get(owner) for owner in before if owner != "host_weights"):
            gc.collect()  # only a reference cycle can still hold them; a full collection costs ~0.25 s
            after = self.ledger.bytes_by_owner()
        free_device_caches(self.device)
        self.last_transfer = {"sleep_s": time.perf_counter() - start,
                              "d2h_copy_s": self.host_weights.last_copy_s if level == 1 and weights_sleep else 0.0,
                              "weight_bytes": self.kv_plan.weight_bytes}
        return {k: v - after.get(k, 0) for k, v in before.items() if v - after.get(k, 0) > 0}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore released components (all, or those in ``tags``: "weights", "kv_cache").

        Weights asleep at level 1 come back from the host copy; at level 2
        their memory is only allocated (no read): push them
        (``update_weights``) or ``reload_weights()`` before generating.
        All or nothing: if a component fails to come back (out of memory),
        what this call restored is released again and the engine is asleep
        exactly as before the call.
        """
        self._check_alive()
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise InvalidRequestError(f"unknown wake_up tags {unknown}; use {list(SLEEP_TAGS)}")
        self._wake(tags, None)

    def _wake(self, tags: list[str], weights) -> None:
        start = time.perf_counter()
        from_host = self.lifecycle.level_of(WEIGHTS) == 1
        try:
            woken = self.lifecycle.wake(tags, weights)
        except BaseException as exc:
            drop_traceback_locals(exc)  # the rolled-back buffers must not live on in the traceback
            free_device_caches(self.device)
            raise
        synchronize(self.device)
        self.last_transfer["wake_s"] = time.perf_counter() - start
        if self.host_weights in woken and from_host:
            self.last_transfer["h2d_copy_s"] = self.host_weights.last_copy_s
        graphs = self.graphs
        self.last_transfer["graph_capture_s"] = graphs.capture_seconds if graphs is not None else 0.0

    def _check_can_update_weights(self, weights) -> None:
        self._check_alive()
        if self.lifecycle.level_of(WEIGHTS) == 1:
            raise EngineSleepingError("the engine sleeps at level 1; call wake_up(['weights']) before update_weights()")
        if not hasattr(weights, "items") and not hasattr(weights, "__iter__"):
            raise InvalidRequestError(
                f"update_weights takes a state dict or an iterable of (name, tensor), got {type(weights).__name__}")

    def update_weights(self, weights) -> int:
        """Copy HF-named tensors into the weights in place; returns how many were loaded.

        While the weights are awake any subset may be given, in as many calls
        as wanted (one tensor per call, as TRL pushes them); after a level-2
        wake the model runs again once every weight has been pushed. While
        they sleep at level 2 their rows wake with these tensors instead, and
        every weight must be given (nothing else could fill the rest); a
        failure leaves them asleep. A mapping is checked completely before
        anything is copied.
        """
        self._check_can_update_weights(weights)
        refill = WEIGHTS in self.sleeping
        items = weights.items() if hasattr(weights, "items") else _name_tensor_pairs(weights)
        try:
            if hasattr(weights, "items"):
                self.model.check_weights(items, require_all=refill, full_only=not self.accepts_rank_slices)
            if refill:
                self._wake([WEIGHTS], items)
                count = self.weights.loaded
            else:
                count = self.weights.load(items)
        except ModelLoadError as exc:
            raise InvalidRequestError(f"update_weights: {exc}") from exc
        synchronize(self.device)
        return count

    def reload_weights(self) -> int:
        """Read every weight again from the model source (the checkpoint the engine started from).

        Awake (after a level-2 wake that only allocated, or to undo pushed
        weights) it loads in place; while the weights sleep at level 2 it
        wakes them from the source, all or nothing, as ``update_weights``
        does with the caller's tensors. At level 1 it is refused (the host
        copy is what waking restores). Returns the number of tensors read.
        """
        self._check_alive()
        level = self.lifecycle.level_of(WEIGHTS)
        if level == 1:
            raise EngineSleepingError("the engine sleeps at level 1; call wake_up(['weights']) before reload_weights()")
        if level == 2:
            self._wake([WEIGHTS], self.source.iter_weights())
            count = self.weights.loaded
        else:
            count = self.weights.load(self.source.iter_weights(), require_all=True)
        synchronize(self.device)
        return count

    def _build_inputs(self, host: HostBatch, graph: tuple[int, int] | None) -> InputBatch:
        if not isinstance(self.ops, TritonOps):
            return build_reference_batch(host, self.device)
        return self.inputs.build(host, graph)

    def _graph_key(self, batch: ScheduledBatch) -> tuple[int, int] | None:
        """The CUDA graph that can run ``batch``: every sequence decodes its last token, plus its drafts."""
        longest = 0
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            if n != 1 + len(seq.draft_tokens) or seq.num_computed_tokens + 1 != seq.num_tokens:
                return None
            longest = max(longest, n)
        # Drafts exist only with speculation; their graphs have room for the configured number of drafts.
        q = 1 if longest == 1 else self.config.speculative.num_speculative_tokens + 1
        return self.graphs.key_for(len(batch), q)

    def _forward(self, inputs: InputBatch) -> torch.Tensor:
        with self.ctx.scope(inputs.metadata):
            return self.model(inputs.input_ids, inputs.positions, self.kv_cache)

    @torch.inference_mode()
    def forward_logits(self, host: HostBatch, graph: tuple[int, int] | None = None,
                       all_rows: bool = False, pending: torch.Tensor | None = None) -> StepLogits | None:
        """Run the model on one step's inputs: logits (model dtype) of the rows that sample (``all_rows``: of
        every row), or None when no row samples. Tensor-parallel ranks other than 0 run the same forward and
        collectives and get None: only rank 0 receives logits. ``pending``: the tokens of the step launched
        before, for inputs still pending on it (``ops.take_pending``).
        """
        self.check_awake()
        inputs = self._build_inputs(host, graph)
        if pending is not None:
            self.ops.take_pending(inputs.input_ids, pending)
        if inputs.graph is not None:  # every real row samples: one per sequence, plus one per draft
            out, rows = self.graphs.replay(inputs.graph), inputs.num_rows
            if out.logits is not None:
                return StepLogits(out.logits[:rows], out.greedy[:rows], out.greedy_logprob[:rows])
            hidden = out.hidden[:rows]
        else:
            hidden = self._forward(inputs)
            if not all_rows:
                hidden = hidden[inputs.logits_indices]
        if not all_rows and not host.logits_indices:
            return None
        logits = self.model.logits(hidden)
        return None if logits is None else StepLogits(logits, None)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> StepOutput:
        """Run one step: (sequence, new tokens, logprob records) for sequences whose step reached their end,
        and the prompt logprob records of prefill chunks that asked for them.

        One token per sequence, or, for a speculating sequence, its accepted
        drafts plus one token from the target model.
        """
        self.check_awake()
        host, seqs, prompt_rows = host_batch(batch, self.block_size)
        # Structured rows' masks: started first, filled on the grammar compiler's thread while this one
        # launches the forward pass and draws the sampler's noise (``GrammarCompiler.fill_later``).
        grammars = [s.grammar for s in seqs if s.grammar is not None]
        masks = grammars[0].compiler.fill_later(grammars) if grammars else None
        try:
            return self._execute(batch, host, seqs, prompt_rows, masks)
        finally:
            if masks is not None:
                masks.settle()  # a step that failed before using them still waits for the fill to end

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, after: LaunchedStep | None, defer: bool = False) -> LaunchedStep:
        """Run one step without waiting for its tokens (async scheduling): the host books the step before
        while this one runs. ``after``: the step launched before, whose tokens this one's pending inputs
        are. Sampled here: steps of ``launchable`` sequences, whose tokens need nothing but the logits (no
        logits processing, grammar, drafts, prompt logprobs or min_tokens ban; ``logprobs=0`` records only
        when the whole step is one-pass: the RL rollout's case, the records from the pass that picks the
        tokens, as in ``execute``). ``defer``: steps of ``deferrable`` sequences (grammars, penalties,
        bans): only the forward pass is launched; ``sample_launched`` samples once ``after`` is booked."""
        self.check_awake()
        host, seqs, prompt_rows = host_batch(batch, self.block_size)
        if defer:
            if prompt_rows or not all(deferrable(s) for s in batch.seqs):
                raise ValueError("launch(defer=True) takes deferrable steps only; execute() runs the others")
        else:
            raw = self.config.logprobs_mode == "raw_logprobs"
            if prompt_rows or not all(launchable(s, raw) for s in batch.seqs):
                raise ValueError("launch() takes launchable steps only; execute() runs the others")
            one_pass = self._one_pass_logprobs(seqs)
            if one_pass is None and any(s.needs_processing for s in seqs):
                raise ValueError("launch() takes logprobs only from a step whose sequences are all one-pass")
        graph = self._graph_key(batch) if self.graphs is not None else None
        step = self.forward_logits(host, graph, pending=None if after is None else after.tokens)
        if defer:
            return LaunchedStep(batch, seqs, None, None, None, step)
        records = None
        if step is None:
            tokens = torch.empty(0, dtype=torch.int64, device=self.device)
        elif one_pass is not None:
            tokens, records = self._one_pass_records(one_pass, *step, seqs)
        else:
            tokens = self._plain_tokens(step.logits, step.greedy, seqs)
        host_copy = None if self.inputs is None else self.inputs.send_tokens(tokens, records)
        return LaunchedStep(batch, seqs, tokens, records, host_copy)

    @torch.inference_mode()
    def sample_launched(self, step: LaunchedStep) -> LaunchedStep:
        """Sample a step launched with ``defer=True``, once the step before it is booked (the grammars have
        its tokens, the penalties count them), as ``execute`` samples the same live rows: the masks filled on
        the grammar compiler's thread, processing, the sampler; then the tokens (and ``logprobs=0`` records, a
        row per sequence, only its token for one that did not ask) start for the host. A sequence that
        finished in the step before gets token 0, which booking drops."""
        if step.tokens is not None:
            return step
        seqs = step.seqs
        live = [i for i, s in enumerate(seqs) if not s.is_finished]
        tokens, records = None, None
        if step.logits is not None and live:  # else nothing samples, or every sequence finished before
            rows = [seqs[i] for i in live]
            grammars = [s.grammar for s in rows if s.grammar is not None]
            masks = grammars[0].compiler.fill_later(grammars) if grammars else None
            try:
                every = len(live) == len(seqs)
                index = None if every else to_device(live, step.logits.logits.device)
                logits, greedy, greedy_logprob = (t if t is None or every else t[index] for t in step.logits)
                one_pass = self._one_pass_logprobs(rows)
                if one_pass is not None:  # its processed sequences have finished: the records execute takes
                    picked, records = self._one_pass_records(one_pass, logits, greedy, greedy_logprob, rows,
                                                             launched=True)
                    at = live
                elif masks is not None and self._masked_one_pass(rows):
                    picked, records = self._masked_race(logits, greedy_logprob, rows, masks, launched=True)
                    at = live
                else:  # the rows that asked, as execute has them (a logsumexp over other rows may round otherwise)
                    lp = [j for j, s in enumerate(rows) if s.params.logprobs is not None]
                    picked, records = self._draw_rows(logits.float(), rows, masks, lp, [0] * len(lp),
                                                      launched=True)
                    at = [live[j] for j in lp]
            finally:
                if masks is not None:
                    masks.settle()
            tokens = picked if every else torch.zeros(len(seqs), dtype=picked.dtype,
                                                      device=picked.device).index_copy_(0, index, picked)
            if records is not None and len(at) < len(seqs):  # the other rows' records: just their tokens
                full = torch.zeros(len(seqs), 3, dtype=records.dtype, device=records.device)
                full[:, 0] = tokens
                records = full.index_copy_(0, to_device(at, records.device), records)
        if tokens is None:
            tokens = torch.zeros(len(seqs), dtype=torch.int64, device=self.device)
        host_copy = None if self.inputs is None else self.inputs.send_tokens(tokens, records)
        return LaunchedStep(step.batch, seqs, tokens, records, host_copy)

    def collect(self, step: LaunchedStep) -> StepOutput:
        """The tokens (and records) of a launched step, once their copy to the host is done (not the steps
        after it)."""
        if step.host is not None:
            tokens, records = step.host.read()
        else:
            tokens, records = step.tokens.tolist(), None if step.records is None else step.records.tolist()
        if records is None:
            return StepOutput([SampledTokens(s, [t]) for s, t in zip(step.seqs, tokens)], [])
        return StepOutput(_with_records(step.seqs, records), [])

    def _plain_tokens(self, logits: torch.Tensor, greedy: torch.Tensor | None,
                      seqs: list[Sequence]) -> torch.Tensor:
        """One token per row on the device: the argmax (the graph's, when it took one) when every row is
        greedy, else the sampler's draw (temperature, top-k/p, min-p)."""
        if all(s.greedy for s in seqs):
            return self.ops.argmax(logits) if greedy is None else greedy
        return self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs], steps=draw_steps(seqs))

    def _execute(self, batch: ScheduledBatch, host: HostBatch, seqs: list[Sequence],
                 prompt_rows: list[PromptRows], masks: PendingMasks | None) -> StepOutput:
        step = self.forward_logits(host, self._graph_key(batch) if self.graphs is not None else None)
        if step is None:
            return StepOutput([], [])
        logits, greedy, greedy_logprob = step
        num_sampling = len(host.logits_indices) - sum(r.count for r in prompt_rows)
        prompt = self._prompt_logprobs(logits[num_sampling:], prompt_rows) if prompt_rows else []
        logits = logits[:num_sampling]
        if not seqs:
            return StepOutput([], prompt)
        one_pass = self._one_pass_logprobs(seqs)
        if one_pass is not None:  # one copy to the host: the records hold the tokens
            _, records = self._one_pass_records(one_pass, logits, greedy, greedy_logprob, seqs)
            return StepOutput(_with_records(seqs, records.tolist()), prompt)
        if masks is not None and self._masked_one_pass(seqs):
            tokens, records = self._masked_race(logits, greedy_logprob, seqs, masks)
            if records is not None:
                return StepOutput(_with_records(seqs, records.tolist()), prompt)
            return StepOutput([SampledTokens(s, [t]) for s, t in zip(seqs, tokens.tolist())], prompt)
        if any(s.needs_processing for s in seqs):
            return StepOutput(self._sample_processed(logits, seqs, masks), prompt)
        return StepOutput([SampledTokens(s, t) for s, t in self._sample(logits, greedy, seqs)], prompt)

    def _one_pass_logprobs(self, seqs: list[Sequence]) -> str | None:
        """The RL cases where ``logprobs=0`` comes from the pass that picks the tokens (raw mode, no drafts,
        nothing processed, some sequence asked): "greedy" when every sequence is greedy (the argmax pass,
        inside the CUDA graph when one ran), "race" when some sample from their whole distribution, else
        None. Sequence flags decided at creation keep this to a few C-level loops at batch 256."""
        if (self.config.logprobs_mode != "raw_logprobs" or all(s.params.logprobs is None for s in seqs)
                or not all(s.one_pass and not s.draft_tokens for s in seqs)):
            return None
        if self._stop_ban_below_min(seqs):
            return None
        return "greedy" if all(s.greedy for s in seqs) else "race"

    def _one_pass_records(self, mode: str, logits: torch.Tensor, greedy: torch.Tensor | None,
                          greedy_logprob: torch.Tensor | None, seqs: list[Sequence],
                          launched: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens and their float64 records (token, raw log-probability, rank), on the device, from the
        pass that picks the tokens (``_one_pass_logprobs``'s ``mode``): "greedy", the argmax pass (inside
        the CUDA graph when one ran; the argmax's rank is 1 by definition, so nothing else needs the
        vocabulary); "race", one race over the batch, the tokens the sampler draws from the same generators.
        ``launched``: the step is sampled after its launch was booked (``draw_steps``)."""
        if mode == "race":
            tokens, records = self.sampler.race_packed(logits, [s.params for s in seqs], [s.generator for s in seqs],
                                                       draw_steps(seqs, launched))
            # A greedy row's token from the race is the argmax (first on ties), but on the GPU the race's
            # logsumexp rounds otherwise than the argmax kernel's (H100: 64x49152 rows differed), and async
            # scheduling keeps a finished sampled row one step longer: the same greedy row would take "race"
            # there and "greedy" in the synchronous step. Its record is the argmax pass's whatever shares its step.
            self._argmax_logprobs(records, logits, greedy_logprob, [i for i, s in enumerate(seqs) if s.greedy])
            return tokens, records
        if greedy is None or greedy_logprob is None:
            greedy, greedy_logprob = self.ops.argmax_logprob(logits)
        ranks = torch.ones_like(greedy_logprob, dtype=torch.float64)
        return greedy, torch.stack([greedy.double(), greedy_logprob.double(), ranks], 1)

    def _argmax_logprobs(self, records: torch.Tensor, logits: torch.Tensor, greedy_logprob: torch.Tensor | None,
                         rows: list[int]) -> None:
        """Greedy ``rows``' logprobs in ``records`` (a race's) replaced by the argmax pass's (the graph's, else one
        pass): the bits a step of greedy rows alone gives them (``_one_pass_records`` says why)."""
        if rows:
            if greedy_logprob is None:
                greedy_logprob = self.ops.argmax_logprob(logits)[1]
            index = to_device(rows, records.device)
            records[index, 1] = greedy_logprob[index].double()

    def _masked_one_pass(self, seqs: list[Sequence]) -> bool:
        """Whether a step's tokens (and ``logprobs=0`` records) come from one race that reads the grammars' masks
        (``_masked_race``): every sequence is one-pass or ``masked_one_pass``, logprobs raw, no drafts, no
        stop-token ban below ``min_tokens`` (a ban is processing; for a grammar row, whether it applies depends
        on the grammar's completeness: ``process_logits`` decides both)."""
        if not all((s.one_pass or s.masked_one_pass) and not s.draft_tokens for s in seqs):
            return False
        if self.config.logprobs_mode != "raw_logprobs" and any(s.params.logprobs is not None for s in seqs):
            return False
        return not self._stop_ban_below_min(seqs)

    def _stop_ban_below_min(self, seqs: list[Sequence]) -> bool:
        """Whether some sequence below its ``min_tokens`` has stop tokens to ban (processing: no one-pass step)."""
        return any(s.params.min_tokens and s.below_min_tokens() and stop_token_bans(s, self.eos_token_ids)
                   for s in seqs)

    def _send_mask(self, bitmask: torch.Tensor) -> torch.Tensor:
        """A step's host grammar bitmask on the device: through the pinned staging of ``StepInputs``
        (``send_mask``: no wait for the step launched before), or a plain copy where there is none."""
        return bitmask.to(self.device) if self.inputs is None else self.inputs.send_mask(bitmask)

    def _masked_race(self, logits: torch.Tensor, greedy_logprob: torch.Tensor | None, seqs: list[Sequence],
                     masks: PendingMasks, launched: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The tokens (and, when some sequence asked, (token, raw logprob, rank) rows for all) of a
        ``_masked_one_pass`` step, on the device: one race over the logits in the model's dtype that reads
        the grammars' int32 bitmask itself. For seeded rows the processed path's tokens (float copy,
        ``apply_bitmask``, the sampler: each row races the same noise, from its generator or its key; unseeded
        rows draw theirs from the global generator in one batch of another shape), its raw records up to the
        rounding of another logsumexp on the GPU; without its copy, unpacking launches and per-row rules: on the
        H100 host those cost ~0.5 ms of a 64-row JSON step (docs/BENCHMARKS.md). The noise (or its keys) is
        prepared while the masks fill. ``launched``: as in ``_one_pass_records``."""
        grammar_rows = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if not masks.serve([seqs[i].grammar for i in grammar_rows]):
            raise RuntimeError("_masked_race: the pending masks are not those of this step's grammar rows")
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        noise, scale = self.sampler.race_noise(logits.shape, logits.device, params, generators,
                                               draw_steps(seqs, launched))
        bitmask = masks.wait()
        if len(masks.states) < len(seqs):  # plain rows beside: every token allowed
            # numpy, on this thread only: torch's CPU fill of a mask this size wakes its OpenMP threads, which
            # spin after it and starve llguidance's pool filling the next masks (docs/BENCHMARKS.md, H100)
            full = np.full((len(seqs), bitmask.shape[1]), -1, dtype=np.int32)
            full[grammar_rows] = bitmask.numpy()
            bitmask = torch.from_numpy(full)
        want = any(s.params.logprobs is not None for s in seqs)
        bitmask = self._send_mask(bitmask)
        tokens, records = self.ops.race_sample(logits, noise, scale, want, bitmask)
        if records is not None:  # plain greedy rows: as in a race without masks
            self._argmax_logprobs(records, logits, greedy_logprob,
                                  [i for i, s in enumerate(seqs) if s.greedy and s.grammar is None])
        return tokens, records

    def _sample(self, logits: torch.Tensor, greedy: torch.Tensor | None,
                seqs: list[Sequence]) -> list[tuple[Sequence, list[int]]]:
        """The common case: no logprobs, no processing beyond a min_tokens ban of stop tokens."""
        if not any(s.draft_tokens for s in seqs):  # one pass and one copy to the host for the whole batch
            banned = self._ban_stop_tokens_below_min(logits, seqs)
            tokens = self._plain_tokens(logits, None if banned else greedy, seqs)
            return [(s, [t]) for s, t in zip(seqs, tokens.tolist())]
        if all(s.params.greedy for s in seqs):
            starts = list(itertools.accumulate((1 + len(s.draft_tokens) for s in seqs), initial=0))
            banned = [self._ban_stop_tokens_below_min(logits[row:row + 1], [seq])
                      for seq, row in zip(seqs, starts) if not seq.draft_tokens]
            targets = (self.ops.argmax(logits) if any(banned) or greedy is None else greedy).tolist()
            return [(s, accept_greedy(s.draft_tokens, targets[row:row + 1 + len(s.draft_tokens)]))
                    for s, row in zip(seqs, starts)]
        logits = logits.float()
        out, row = [], 0
        for seq in seqs:  # drafts are never scheduled below min_tokens, so no stop-token ban is needed here
            rows = 1 + len(seq.draft_tokens)
            out.append((seq, self._verify(logits[row:row + rows], seq)))
            row += rows
        return out

    def _verify(self, logits: torch.Tensor, seq: Sequence) -> list[int]:
        """Tokens of one sequence's step from its rows of logits (1 + drafts)."""
        if not seq.draft_tokens:
            self._ban_stop_tokens_below_min(logits, [seq])
            return self.sampler(logits.float(), [seq.params], [seq.generator], steps=draw_steps([seq])).tolist()
        if seq.params.greedy:
            return accept_greedy(seq.draft_tokens, self.ops.argmax(logits).tolist())
        return verify_drafts(self.sampler, logits.float(), seq.draft_tokens, seq.params, seq.generator)

    def _sample_processed(self, logits: torch.Tensor, seqs: list[Sequence],
                          masks: PendingMasks | None) -> list[SampledTokens]:
        """A step with sequences that ask for logprobs or logits processing (they never speculate; others
        in the same step may): those are sampled together, one row each, in a few batched operations.
        ``masks``: those of the sequences with a grammar (all of them sample here), being filled."""
        starts = list(itertools.accumulate((1 + len(s.draft_tokens) for s in seqs), initial=0))
        out: list[SampledTokens | None] = [None] * len(seqs)
        plain = [i for i, s in enumerate(seqs) if not s.draft_tokens]
        for i, seq in enumerate(seqs):
            if seq.draft_tokens:
                out[i] = SampledTokens(seq, self._verify(logits[starts[i]:starts[i + 1]], seq))
        if plain:
            rows = logits if len(plain) == len(seqs) else logits[torch.tensor([starts[i] for i in plain],
                                                                              device=logits.device)]
            rows = rows.float()  # a copy when the logits are bf16; process_logits writes into it
            for i, (token, record) in zip(plain, self._sample_rows(rows, [seqs[i] for i in plain], masks)):
                out[i] = SampledTokens(seqs[i], [token], None if record is None else [record])
        return out

    def _sample_rows(self, logits: torch.Tensor, seqs: list[Sequence],
                     masks: PendingMasks | None) -> list[tuple[int, TokenLogprob | None]]:
        """One token per row of ``logits`` (float32, one row per sequence, modified in place) and, for the
        sequences that asked, its logprob record in this engine's ``logprobs_mode``. ``masks``: see
        ``process_logits``."""
        lp = [j for j, s in enumerate(seqs) if s.params.logprobs is not None]
        ks = [seqs[j].params.logprobs for j in lp]
        tokens, packed = self._draw_rows(logits, seqs, masks, lp, ks)
        if packed is None:
            return [(t, None) for t in tokens.tolist()]
        by_row = dict(zip(lp, unpack_records(packed.tolist(), ks)))
        return [(t, by_row.get(j)) for j, t in enumerate(tokens.tolist())]

    def _draw_rows(self, logits: torch.Tensor, seqs: list[Sequence], masks: PendingMasks | None, lp: list[int],
                   ks: list[int], launched: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``_sample_rows`` on the device: the tokens (int64) and, for rows ``lp``, their records packed
        (``pack_records``, top-k ``ks``; None without rows), in this engine's ``logprobs_mode``. ``launched``:
        as in ``_one_pass_records``."""
        mode = self.config.logprobs_mode
        every = len(lp) == len(seqs)
        index = None if every or not lp else to_device(lp, logits.device)
        raw = None
        if lp and mode.startswith("raw"):  # taken before processing changes the logits in place
            untouched = not any(s.params.processes_logits or s.below_min_tokens() for s in seqs)
            raw = logits if every and untouched else None
            raw = (logits.clone() if every else logits[index]) if raw is None else raw
        params, generators = [s.params for s in seqs], [s.generator for s in seqs]
        steps = draw_steps(seqs, launched)
        race = self.sampler.draw_race(logits, params, generators, steps)  # needs no logits: drawn while masks fill
        process_logits(logits, seqs, self.eos_token_ids, masks, self._send_mask)
        tokens = self.sampler(logits, params, generators, race, steps)
        if not lp:
            return tokens, None
        if raw is not None:
            scores, lse = raw, (raw.logsumexp(-1) if mode == "raw_logprobs" else None)
        else:
            scores, lse = self._processed_scores(logits, [seqs[j] for j in lp], lp, mode), None
        return tokens, pack_records(scores, tokens if every else tokens[index], ks, lse)

    def _processed_scores(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int],
                          mode: str) -> torch.Tensor:
        """The distribution each row was sampled from, as log-probabilities ("processed_logprobs") or logits
        ("processed_logits", -inf where filtered): after processing, temperature, top-k, top-p, min-p.
        Greedy rows use the processed logits themselves (no temperature)."""
        sub = logits[to_device(rows, logits.device)]
        scores = sub.log_softmax(-1) if mode == "processed_logprobs" else sub.clone()
        sampled = [j for j, s in enumerate(seqs) if not s.params.greedy]
        if sampled:
            index = to_device(sampled, logits.device)
            filtered = self.sampler.filtered_logits(sub[index], [seqs[j].params for j in sampled])
            scores[index] = filtered.log_softmax(-1) if mode == "processed_logprobs" else filtered
        return scores

    def _prompt_logprobs(self, logits: torch.Tensor, prompt_rows: list[PromptRows]) -> list[PromptLogprobRecords]:
        """Records of prompt tokens from the rows predicting them: the model's own log-probabilities, whatever
        ``logprobs_mode`` says (as in vLLM, the mode applies to sampled tokens; prompt tokens are never
        processed)."""
        logits = logits.float()
        targets, ks = [], []
        for r in prompt_rows:
            targets += r.seq.token_ids[r.first:r.first + r.count]
            ks += [r.seq.params.prompt_logprobs] * r.count
        records = logprob_records(logits, to_device(targets, logits.device), ks, logits.logsumexp(-1))
        out, at = [], 0
        for r in prompt_rows:
            out.append(PromptLogprobRecords(r.seq, r.first, records[at:at + r.count]))
            at += r.count
        return out

    @torch.inference_mode()
    def all_logits(self, batch: ScheduledBatch) -> torch.Tensor:
        """Float32 logits [T, vocab] of every token of a single-sequence batch (scoring, tests)."""
        self.check_awake()
        return self.forward_logits(host_batch(batch, self.block_size)[0], all_rows=True).logits.float()

    @torch.inference_mode()
    def embed(self, token_lists: list[list[int]], pooling: str, normalized: bool, max_batch_tokens: int) -> torch.Tensor:
        """Pooled final hidden states [N, hidden] (float32, CPU) of complete prompts, KV-free."""
        self.check_awake()
        if pooling not in POOLING_METHODS:
            raise InvalidRequestError(f"pooling must be one of {POOLING_METHODS}, got {pooling!r}")
        rows: list[torch.Tensor | None] = [None] * len(token_lists)
        for group in chunks_by_tokens(token_lists, max_batch_tokens):
            input_ids, positions, meta, starts = dense_batch([token_lists[i] for i in group], self.device)
            with self.ctx.scope(meta):
                hidden = self.model(input_ids, positions, None)
            pooled = pool(hidden, starts, pooling)
            if normalized:
                pooled = normalize(pooled)
            for i, row in zip(group, pooled.cpu()):
                rows[i] = row
        return torch.stack(rows)

    def _ban_stop_tokens_below_min(self, logits: torch.Tensor, seqs: list[Sequence]) -> bool:
        """Mask the stop tokens of sequences still below ``min_tokens``; whether any row changed."""
        changed = False
        for row, seq in enumerate(seqs):
            banned = stop_token_bans(seq, self.eos_token_ids)
            if banned:
                logits[row, sorted(banned)] = float("-inf")
                changed = True
        return changed

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def rank_reports(self) -> list[ShutdownReport]:
        """The shutdown report of every tensor-parallel rank this runner drives: here just its own."""
        return [self.shutdown_report or ShutdownReport()]

    def shutdown(self, strict: bool = False) -> ShutdownReport:
        """Release every component (reverse table order), free device caches, verify.

        Idempotent: a second call returns the first call's report. A tensor
        still alive afterwards is reported with the chain of references that
        holds it; ``strict=True`` raises ResourceLeakError instead of warning.
        A step of the release that fails is reported too (``errors``) and does
        not stop the others.
        """
        if self.shutdown_report is not None:
            return self.shutdown_report
        start = time.perf_counter()
        self.closed = True
        errors = []
        try:
            synchronize(self.device)
        except RuntimeError as exc:  # a failed kernel must not stop the release
            errors.append(f"device synchronize failed: {exc}")
        released = self.ledger.bytes_by_owner()
        errors += self.lifecycle.shutdown()
        self.rpc_worker = None  # what collective_rpc calls kept on it lives as long as the runner runs
        if self.tp_group is not None:  # a group whose row never acquired still holds its store
            self.tp_group.destroy()
        try:
            free_device_caches(self.device)
        except Exception as exc:  # noqa: BLE001 - reported, never turned into a clean report
            drop_traceback_locals(exc)
            errors.append(f"freeing the device caches failed: {type(exc).__name__}: {exc}")
        # Releasing dropped the last references, so refcounting has normally freed everything already; a
        # full collection (~0.25 s on a heap with transformers imported) runs only when something is left
        # (inside trace_survivors, which then finds who holds what reference cycles do not explain).
        live = self.ledger.live_entries()
        survivors = trace_survivors((e.ref, e.fixed_nbytes) for e in live) if live else []
        del live
        self.shutdown_report = ShutdownReport(released, survivors, time.perf_counter() - start, errors)
        if not self.shutdown_report.clean:
            if strict:
                raise ResourceLeakError(str(self.shutdown_report))
            warnings.warn(str(self.shutdown_report), ResourceWarning, stacklevel=2)
        return self.shutdown_report
