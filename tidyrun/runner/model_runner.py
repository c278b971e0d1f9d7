"""ModelRunner: builds the model and KV cache on a device and runs scheduled batches.

Owns device memory: model weights (``weights``, one WeightArena buffer), the
RoPE table (``rope``, a buffer of the model), the KV cache (``kv_cache``) and,
on the Triton path, the step-input buffers (``inputs``) and the CUDA graphs
with their memory pool (``cuda_graphs``), each registered with
``self.ledger`` where it is allocated; and, after a level-1 sleep, the pinned
host copy of the weights (``host_weights``). ``shutdown`` releases them in
reverse order of acquisition (graphs before the buffers they read, those
before the KV cache and weights) and then proves, through the ledger's weak
references, that none survived. ``sleep`` and ``wake_up`` release and
restore the same components without rebuilding the model; graphs bake in
buffer addresses, so they are captured again on every wake.

As one rank of a tensor-parallel engine (``tp``), the runner holds only its
slice of the weights and KV heads and owns the rank's ``TPGroup`` (its
communicators, ledger owner ``process_group``): shutdown destroys the group
after the CUDA graphs and the KV cache (acquired later, released earlier) and
then verifies, like every tensor, that the group object is dead. The same
code runs the driver (rank 0, which samples) and the workers (forward only,
see ``forward_logits``).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ..attention import ForwardContext
from ..config import EngineConfig, ModelConfig
from ..distributed.rank import TPRank
from ..distributed.sharding import TPShard
from ..audit import Survivor, survivor, unique_storage_bytes
from ..errors import (EngineShutdownError, EngineSleepingError, InvalidRequestError, ModelLoadError,
                      OutOfResourcesError, ResourceLeakError)
from ..kv_cache import KVCache, bytes_per_block
from ..loader import ModelSource
from ..model.llama import LlamaForCausalLM
from ..model.ops import TorchOps, TritonOps
from ..resources import ResourceLedger, drop_traceback_locals, free_device_caches
from ..sampling import Sampler
from ..scheduler import ScheduledBatch
from ..sequence import Sequence
from .device import resolve_device, resolve_dtype, synchronize
from .cuda_graphs import CudaGraphManager, default_capture_sizes
from .input_batch import HostBatch, InputBatch, StepInputs, build_reference_batch, host_batch
from .pooling import POOLING_METHODS, chunks_by_tokens, dense_batch, normalize, pool
from .weights import WeightArena
from ..spec_decode import accept_greedy, verify_drafts

SLEEP_TAGS = ("weights", "kv_cache")

logger = logging.getLogger("tidyrun")

_CPU_KV_BUDGET = 1 << 30  # 1 GiB unless the user says otherwise; pages are only touched when used


@dataclass
class ShutdownReport:
    """What a shutdown released and what, if anything, survived it."""

    released_bytes: dict[str, int] = field(default_factory=dict)  # by owner, live before release
    survivors: list[Survivor] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def clean(self) -> bool:
        return not self.survivors

    @property
    def leaked_bytes(self) -> int:
        """Bytes the survivors keep alive, each shared storage counted once."""
        return unique_storage_bytes(self.survivors)

    def __str__(self) -> str:
        total = sum(self.released_bytes.values())
        head = f"released {total / 2**20:.1f} MiB ({', '.join(f'{k}={v / 2**20:.1f} MiB' for k, v in self.released_bytes.items())}) in {self.seconds * 1e3:.0f} ms"
        if self.clean:
            return head + "; nothing survived"
        lines = [head, f"{len(self.survivors)} tensor(s) survived shutdown, holding {self.leaked_bytes / 2**20:.1f} MiB:"]
        lines += [f"  {s.description} ({s.nbytes} bytes) held by {s.chain}" for s in self.survivors]
        return "\n".join(lines)


def _name_tensor_pairs(items):
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise InvalidRequestError(f"update_weights: expected (name, tensor) pairs, got {type(item).__name__}")
        yield item


class StepLogits(NamedTuple):
    """A step's logits (model dtype) of the rows that sample, and their argmax when the CUDA graph took it."""
    logits: torch.Tensor
    greedy: torch.Tensor | None


class ModelRunner:
    def __init__(self, source: ModelSource, config: EngineConfig, eos_token_ids: frozenset[int],
                 keep_host_buffers: bool = True, tp: TPRank | None = None) -> None:
        self.ledger = ResourceLedger()
        self.tp = tp
        self.tp_group = tp.group if tp is not None else None
        self.closed = False
        self.source = source
        self.model: LlamaForCausalLM | None = None
        self.arena: WeightArena | None = None
        self.kv_cache: KVCache | None = None
        self.keep_host_buffers = keep_host_buffers
        self.sleeping: set[str] = set()  # components released by sleep(), from SLEEP_TAGS
        self.sleep_level: int | None = None
        self.last_transfer: dict[str, float] = {}
        self.model_config: ModelConfig = source.config
        self.shard = tp.shard if tp is not None else TPShard.of(source.config)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        self.block_size = config.cache.block_size
        self.max_model_len = self._resolve_max_model_len(config)
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()
        self.ctx = ForwardContext()
        self.config = config
        self.ops = self._choose_ops(config)
        self.graph_sizes = self._graph_sizes(config)
        self.inputs: StepInputs | None = None
        self.graphs: CudaGraphManager | None = None
        self._graphs_warm = False
        self.shutdown_report: ShutdownReport | None = None
        self.startup_seconds: dict[str, float] = {}
        try:
            t0 = time.perf_counter()
            self._load_model(source)
            t1 = time.perf_counter()
            self.num_kv_blocks = self._num_kv_blocks(config)
            if self.tp_group is not None:
                self.tp_group.connect()
                # Tracked (as an object, its communicator memory unmeasured) so shutdown proves it is gone.
                self.ledger.track("process_group", f"tp_group.rank{self.shard.rank}", self.tp_group.pg, nbytes=0,
                                  device=str(self.device))
            self._allocate_kv_cache()
            synchronize(self.device)
            t2 = time.perf_counter()
            self._build_step_state()
            self.startup_seconds = {"weights": t1 - t0, "kv_cache": t2 - t1,
                                    "cuda_graphs": self.graphs.capture_seconds if self.graphs else 0.0}
            logger.info("model runner ready on %s (%s kernels): weights %.2f s, KV cache of %d blocks %.2f s, "
                        "%s", self.device, self.ops.name, self.startup_seconds["weights"], self.num_kv_blocks,
                        self.startup_seconds["kv_cache"], self._graph_summary())
        except BaseException as exc:
            # Give back what was taken before re-raising: the half-built model must not stay
            # alive through the frames of the traceback the caller is about to hold.
            drop_traceback_locals(exc)
            self.shutdown()
            raise

    def _choose_ops(self, config: EngineConfig) -> TorchOps:
        kernels = config.kernels or ("triton" if self.device.type == "cuda" else "torch")
        if kernels == "triton" and self.device.type != "cuda":
            raise InvalidRequestError("kernels='triton' needs a CUDA device; the CPU runs kernels='torch'")
        if kernels == "torch":
            return TorchOps()
        return TritonOps(torch.cuda.get_device_properties(self.device).multi_processor_count, self.ctx)

    def _graph_summary(self) -> str:
        if self.graphs is None:
            return "no CUDA graphs"
        return (f"{len(self.graphs.keys)} CUDA graphs ({self.graphs.sizes}: batch sizes by tokens per sequence) "
                f"captured in {self.graphs.capture_seconds:.2f} s, pool {self.graphs.pool_bytes / 2**20:.0f} MiB")

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

    def _build_step_state(self) -> None:
        """Step-input buffers and CUDA graphs (Triton path only); they need the weights and KV cache in place.

        All or nothing: if a capture fails, what was built is dropped before the error propagates.
        """
        if not isinstance(self.ops, TritonOps):
            return
        mc, cfg = self.model_config, self.config
        group = mc.num_heads // mc.num_kv_heads
        # compute_logits() sends a whole prompt (up to max_model_len tokens) through one step.
        inputs = StepInputs(self.block_size, group, self.shard.num_kv_heads, max(cfg.max_num_batched_tokens, self.max_model_len),
                            cfg.max_num_seqs, -(-self.max_model_len // self.block_size), self.device, self.ledger)
        graphs = None
        if self.graph_sizes is not None:
            graphs = CudaGraphManager(self.graph_sizes, inputs, group, self.device, self.ledger)
            try:
                # Kernels are compiled once per process; a recapture after a wake skips the warm-up runs.
                graphs.capture(self.model, self.kv_cache, self.ctx, warm_up=not self._graphs_warm)
            except BaseException:
                graphs.release()
                raise
            self._graphs_warm = True
        self.inputs, self.graphs = inputs, graphs

    def _drop_step_state(self) -> None:
        """Graphs first (they read the input buffer and bake in weight/KV addresses), then the buffers."""
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None
        self.inputs = None

    def _resolve_max_model_len(self, config: EngineConfig) -> int:
        limit = self.model_config.max_position_embeddings
        if config.max_model_len is None:
            return limit
        if config.max_model_len > limit:
            raise InvalidRequestError(
                f"max_model_len={config.max_model_len} exceeds the model's context length ({limit})"
            )
        return config.max_model_len

    def _load_model(self, source: ModelSource) -> None:
        self.model = LlamaForCausalLM(self.model_config, self.max_model_len, self.ctx, self.dtype, self.ops,
                                      self.shard, self.tp_group)
        self.arena = WeightArena(self.model, self.device, self.dtype, self.ledger, self.keep_host_buffers)
        self._place_weights()
        self.model.load_weights(source.iter_weights())

    def _place_weights(self) -> None:
        """Allocate the weight buffer and the RoPE table (contents of the weights still to be filled)."""
        self.arena.materialize()
        self._build_rope()

    def _build_rope(self) -> None:
        rotary = self.model.model.rotary
        rotary.build(self.device)
        self.ledger.track("rope", "rope.cos", rotary.cos)
        self.ledger.track("rope", "rope.sin", rotary.sin)

    def _allocate_kv_cache(self) -> None:
        mc = self.model_config
        self.kv_cache = KVCache(mc.num_layers, self.num_kv_blocks, self.block_size, self.shard.num_kv_heads,
                                mc.head_dim, self.dtype, self.device, self.ledger)

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        mc, cache = self.model_config, config.cache
        per_block = bytes_per_block(mc.num_layers, self.block_size, self.shard.num_kv_heads, mc.head_dim, self.dtype)
        blocks_per_seq = -(-self.max_model_len // self.block_size)
        if cache.num_blocks is not None:
            num_blocks = cache.num_blocks
        else:
            budget = cache.memory_bytes if cache.memory_bytes is not None else self._default_kv_budget(config)
            num_blocks = min(budget // per_block, blocks_per_seq * config.max_num_seqs)
        if self.tp is not None:  # one block id must mean the same slots on every rank
            num_blocks = self.tp.agree_num_blocks(int(num_blocks))
        if num_blocks * self.block_size < self.max_model_len:
            if config.max_model_len is not None or num_blocks < 1:
                raise OutOfResourcesError(
                    f"the KV cache holds {num_blocks} blocks ({num_blocks * self.block_size} tokens), "
                    f"less than one sequence of max_model_len={self.max_model_len} tokens; "
                    "give it more memory or lower max_model_len"
                )
            self.max_model_len = num_blocks * self.block_size
        return int(num_blocks)

    def _default_kv_budget(self, config: EngineConfig) -> int:
        if self.device.type != "cuda":
            return _CPU_KV_BUDGET
        free, total = torch.cuda.mem_get_info(self.device)
        mc = self.model_config
        elem = torch.empty((), dtype=self.dtype).element_size()
        # Peak activations of the largest step, plus float32 logits/sort buffers of a full batch.
        activations = config.max_num_batched_tokens * (6 * mc.hidden_size + 4 * mc.intermediate_size
                                                       + mc.q_size + 2 * mc.kv_size) * elem
        logits = config.max_num_seqs * mc.vocab_size * 4 * 4
        budget = int(config.cache.gpu_memory_utilization * total) - (total - free) - activations - logits - (512 << 20)
        if budget <= 0:
            raise OutOfResourcesError(
                f"no device memory left for the KV cache: {free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB "
                f"with gpu_memory_utilization={config.cache.gpu_memory_utilization}"
            )
        return budget

    def _check_alive(self) -> None:
        if self.closed:
            raise EngineShutdownError("the model runner has been shut down")

    def check_awake(self) -> None:
        self._check_alive()
        if self.sleeping:
            raise EngineSleepingError(
                f"the engine is asleep (level {self.sleep_level}; released: {', '.join(sorted(self.sleeping))}); "
                "call wake_up() first")

    # -- sleep / wake / weight updates ---------------------------------------------------

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Release device memory: level 1 keeps the weights in pinned host memory, level 2 discards them.

        Returns the device bytes released, by ledger owner.
        """
        self._check_alive()
        if level not in (1, 2):
            raise InvalidRequestError(f"sleep level must be 1 or 2, got {level!r}")
        if self.sleeping:
            raise InvalidRequestError(f"the engine is already asleep (level {self.sleep_level})")
        synchronize(self.device)
        before = self.ledger.bytes_by_owner()
        start = time.perf_counter()
        self._drop_step_state()
        try:
            if level == 1:
                self.arena.offload()
            else:
                self.arena.release()
                self.arena.host = None
        except BaseException:
            if self.arena.flat is not None:  # still awake: give the steps back their buffers and graphs
                self._build_step_state()
            raise
        offload = time.perf_counter() - start
        self.model.model.rotary.release()
        self.kv_cache = None
        gc.collect()
        free_device_caches(self.device)
        self.sleeping, self.sleep_level = set(SLEEP_TAGS), level
        self.last_transfer = {"sleep_s": time.perf_counter() - start, "offload_s": offload,
                              "d2h_copy_s": self.arena.last_copy_s if level == 1 else 0.0,
                              "weight_bytes": self.arena.nbytes}
        after = self.ledger.bytes_by_owner()
        return {k: v - after.get(k, 0) for k, v in before.items() if v - after.get(k, 0) > 0}

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore released components (all, or those in ``tags``: "weights", "kv_cache")."""
        self._check_alive()
        tags = list(SLEEP_TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in SLEEP_TAGS]
        if unknown:
            raise InvalidRequestError(f"unknown wake_up tags {unknown}; use {list(SLEEP_TAGS)}")
        start = time.perf_counter()
        if "weights" in tags and "weights" in self.sleeping:
            if self.sleep_level == 1:
                self.arena.restore()
                self.last_transfer["restore_s"] = time.perf_counter() - start
                self.last_transfer["h2d_copy_s"] = self.arena.last_copy_s
                self._build_rope()
            else:
                self._place_weights()
                self.model.load_weights(self.source.iter_weights())
                self.last_transfer["reload_s"] = time.perf_counter() - start
            self._mark_awake("weights")
        if "kv_cache" in tags and "kv_cache" in self.sleeping:
            self._allocate_kv_cache()
            self._mark_awake("kv_cache")
        synchronize(self.device)
        self.last_transfer["wake_s"] = time.perf_counter() - start
        self.last_transfer["graph_capture_s"] = self.graphs.capture_seconds if self.graphs else 0.0

    def _mark_awake(self, tag: str) -> None:
        if self.sleeping == {tag}:
            # The last component is back; a failure here leaves the engine asleep on ``tag``, so a later
            # wake_up() can retry instead of steps running without their buffers.
            self._build_step_state()
        self.sleeping.discard(tag)
        if not self.sleeping:
            self.sleep_level = None

    def _check_can_update_weights(self, weights) -> None:
        self._check_alive()
        if "weights" in self.sleeping and self.sleep_level == 1:
            raise EngineSleepingError("the engine sleeps at level 1; call wake_up(['weights']) before update_weights()")
        if not hasattr(weights, "items") and not hasattr(weights, "__iter__"):
            raise InvalidRequestError(
                f"update_weights takes a state dict or an iterable of (name, tensor), got {type(weights).__name__}")

    def update_weights(self, weights) -> int:
        """Copy HF-named tensors into the weights in place; returns how many were loaded.

        While awake any subset may be given. Asleep at level 2 the weights are
        re-allocated and every weight must be given (nothing else could fill
        the rest). A mapping is checked completely before anything is copied.
        """
        self._check_can_update_weights(weights)
        refill = "weights" in self.sleeping
        if not hasattr(weights, "items"):
            weights = _name_tensor_pairs(weights)
        try:
            if hasattr(weights, "items"):
                self.model.check_weights(weights.items(), require_all=refill)
                weights = weights.items()
            if refill:
                self._place_weights()
            try:
                loaded = self.model.load_weights(weights, require_all=refill)
            except BaseException:
                if refill:  # leave no half-filled buffer behind: back to the released state
                    self.arena.release()
                    self.model.model.rotary.release()
                raise
        except ModelLoadError as exc:
            raise InvalidRequestError(f"update_weights: {exc}") from exc
        if refill:
            self._mark_awake("weights")
        synchronize(self.device)
        return len(loaded)

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
                       all_rows: bool = False) -> StepLogits | None:
        """Run the model on one step's inputs: logits (model dtype) of the rows that sample (``all_rows``: of
        every row), or None when no row samples. Tensor-parallel ranks other than 0 run the same forward and
        collectives and get None: only rank 0 receives logits.
        """
        self.check_awake()
        inputs = self._build_inputs(host, graph)
        if inputs.graph is not None:  # every real row samples: one per sequence, plus one per draft
            out, rows = self.graphs.replay(inputs.graph), inputs.num_rows
            if out.logits is not None:
                return StepLogits(out.logits[:rows], out.greedy[:rows])
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
    def execute(self, batch: ScheduledBatch) -> list[tuple[Sequence, list[int]]]:
        """Run one step; returns (sequence, new tokens) for sequences whose step reached their end.

        One token per sequence, or, for a speculating sequence, its accepted
        drafts plus one token from the target model.
        """
        self.check_awake()
        host, seqs = host_batch(batch, self.block_size)
        step = self.forward_logits(host, self._graph_key(batch) if self.graphs is not None else None)
        if not seqs:
            return []
        logits, greedy = step
        drafts = any(s.draft_tokens for s in seqs)
        if all(s.params.greedy for s in seqs):  # one argmax and one copy to the host for the whole batch
            if not drafts:
                if self._ban_stop_tokens_below_min(logits, seqs) or greedy is None:
                    greedy = self.ops.argmax(logits)
                return [(s, [t]) for s, t in zip(seqs, greedy.tolist())]
            starts = list(itertools.accumulate((1 + len(s.draft_tokens) for s in seqs), initial=0))
            banned = [self._ban_stop_tokens_below_min(logits[row:row + 1], [seq])
                      for seq, row in zip(seqs, starts) if not seq.draft_tokens]
            targets = (self.ops.argmax(logits) if any(banned) or greedy is None else greedy).tolist()
            return [(s, accept_greedy(s.draft_tokens, targets[row:row + 1 + len(s.draft_tokens)]))
                    for s, row in zip(seqs, starts)]
        logits = logits.float()
        if not drafts:
            self._ban_stop_tokens_below_min(logits, seqs)
            tokens = self.sampler(logits, [s.params for s in seqs], [s.generator for s in seqs])
            return [(s, [t]) for s, t in zip(seqs, tokens.tolist())]
        out, row = [], 0
        for seq in seqs:  # drafts are never scheduled below min_tokens, so no stop-token ban is needed here
            rows = 1 + len(seq.draft_tokens)
            seq_logits = logits[row:row + rows]
            if seq.draft_tokens:
                out.append((seq, verify_drafts(self.sampler, seq_logits, seq.draft_tokens, seq.params, seq.generator)))
            else:
                self._ban_stop_tokens_below_min(seq_logits, [seq])
                out.append((seq, self.sampler(seq_logits, [seq.params], [seq.generator]).tolist()))
            row += rows
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
            if seq.below_min_tokens():
                banned = set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else set(self.eos_token_ids))
                if banned:
                    logits[row, sorted(banned)] = float("-inf")
                    changed = True
        return changed

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def _release(self, owner: str) -> None:
        """Drop the runner's reference to the component that owns ``owner``'s tensors."""
        if owner in ("cuda_graphs", "inputs", "inputs_host"):
            self._drop_step_state()  # graphs before the buffers they read, whichever owner comes first
        elif owner == "kv_cache":
            self.kv_cache = None
        elif owner == "host_weights":
            if self.arena is not None:
                self.arena.host = None
        elif owner in ("weights", "rope"):
            self.model = None  # the RoPE table is a buffer of the model
            self.arena = None
        elif owner == "process_group":
            self.tp_group.destroy()  # acquired after the weights, before the KV cache and any CUDA graph

    def rank_reports(self) -> list[ShutdownReport]:
        """The shutdown report of every tensor-parallel rank this runner drives: here just its own."""
        return [self.shutdown_report or ShutdownReport()]

    def shutdown(self, strict: bool = False) -> ShutdownReport:
        """Release every component (reverse acquisition order), free device caches, verify.

        Idempotent: a second call returns the first call's report. A tensor
        still alive afterwards is reported with the chain of references that
        holds it; ``strict=True`` raises ResourceLeakError instead of warning.
        """
        if self.shutdown_report is not None:
            return self.shutdown_report
        start = time.perf_counter()
        self.closed = True
        try:
            synchronize(self.device)
        except RuntimeError as exc:  # a failed kernel must not stop the release
            warnings.warn(f"device synchronize failed during shutdown: {exc}", RuntimeWarning, stacklevel=2)
        released = self.ledger.bytes_by_owner()
        for owner in self.ledger.owners_for_release():
            self._release(owner)
        if self.tp_group is not None:  # a group that never connected still holds its store
            self.tp_group.destroy()
        gc.collect()
        free_device_caches(self.device)
        survivors = [s for s in (survivor(e.ref, e.fixed_nbytes) for e in self.ledger.live_entries()) if s is not None]
        self.shutdown_report = ShutdownReport(released, survivors, time.perf_counter() - start)
        if survivors:
            if strict:
                raise ResourceLeakError(str(self.shutdown_report))
            warnings.warn(str(self.shutdown_report), ResourceWarning, stacklevel=2)
        return self.shutdown_report
