"""The rows of the runner's lifecycle table (see lifecycle.py for the protocol and the loops).

Each class owns one kind of memory and is the only holder of it: the runner
reaches the model, the KV cache, the step buffers and the graphs through
these rows, so releasing a row drops the last reference. Every allocation is
registered with the runner's ledger where it is made.

Not rows, because they own no device or pinned memory between calls: the
sampler and the n-gram proposer (host state only), and pooling (``embed``
allocates per call and keeps nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..attention import ForwardContext
from ..errors import EngineSleepingError
from ..kv_cache import KVCache
from ..model.llama import LlamaForCausalLM
from ..resources import ResourceLedger, pinned_host_buffer, unpin_host_buffer
from .cuda_graphs import CudaGraphManager
from .device import synchronize
from .input_batch import StepInputs
from .kv_plan import KVPlan, check_agreed_blocks
from .lifecycle import KV_CACHE, STEP, WEIGHTS, Component, Transition
from .weights import WeightArena


class Weights(Component):
    """The model and its parameters, all views into one WeightArena buffer (ledger owner ``weights``).

    Owns device memory: the arena. Level 1 and 2 drop the device buffer and
    keep the (meta-shaped) model, so parameter objects keep their identity;
    from level 1 the host copy (the next row) fills the buffer again. A
    level-2 wake fills it from the tensors the transition brings (the
    caller's for ``update_weights`` while asleep, the model source's for
    ``reload_weights``) or, bringing none, only allocates it: RL loops push
    new weights right after, and re-reading a checkpoint nobody wants cost
    seconds (vLLM's level 2 does the same).

    ``missing`` is what makes that safe: the HF names whose values the arena
    does not hold (all of them after a level-2 sleep, none after a full
    fill). Every load removes what it copies, one tensor at a time, whoever
    calls it: the runner's pushes and a ``collective_rpc`` function's
    ``runner.model.load_weights`` (vLLM's spelling) alike, because the model
    reports its loads to a ``WeightStatus`` this component gives it. The
    runner refuses to run the model while any is missing, instead of
    computing with uninitialised memory; a load while the arena sleeps is
    refused by name instead of failing inside a copy.
    """

    owner, tag = "weights", WEIGHTS

    def __init__(self, build_model: Callable[[], LlamaForCausalLM], source, device: torch.device, dtype: torch.dtype,
                 ledger: ResourceLedger, accepts_rank_slices: bool = False) -> None:
        self._build_model, self._source = build_model, source
        # Pushed tensors may be this rank's slice (a launched rank's caller may hold only its shard); the
        # checkpoint's must have their full shapes.
        self._pushed_full_only = not accepts_rank_slices
        self.device, self.dtype, self._ledger = device, dtype, ledger
        self.model: LlamaForCausalLM | None = None
        self.arena: WeightArena | None = None
        self.status = WeightStatus()  # which names the arena holds; shared with the model, which reports loads
        self.loaded = 0  # tensors loaded by the last fill

    def acquire(self) -> None:
        self.model = self._build_model()
        self.status.reset(frozenset(self.model.weight_shards()))
        self.model.weight_status = self.status
        self.arena = WeightArena(self.model, self.device, self.dtype, self._ledger)
        self.arena.materialize()
        self._fill(self._source.iter_weights())

    def _fill(self, weights, full_only: bool = True) -> None:
        """Load every weight (a missing one raises ModelLoadError); only then is none missing."""
        self.loaded = len(self.model.load_weights(weights, require_all=True, full_only=full_only))

    def load(self, weights, require_all: bool = False) -> int:
        """Copy (HF name, tensor) pairs into the awake arena in place; returns how many were loaded.

        The names loaded stop being missing (the model reports each one as it
        is copied, so a load that fails part-way keeps those before it).
        """
        return len(self.model.load_weights(weights, require_all=require_all, full_only=self._pushed_full_only))

    @property
    def names(self) -> frozenset[str]:
        """Every HF name this rank's model needs."""
        return self.status.names

    @property
    def missing(self) -> frozenset[str]:
        """Of ``names``, the ones the arena holds no value for."""
        return frozenset(self.status.missing)

    def release(self) -> None:
        self.model = None
        self.arena = None

    def sleep(self, t: Transition) -> None:
        self.arena.release()
        self.status.sleep(t.level)

    def wake(self, t: Transition) -> None:
        self.arena.materialize()
        self.status.wake()
        if t.level == 2 and t.weights is not None:
            self._fill(t.weights, self._pushed_full_only)

    def unwake(self, t: Transition) -> None:
        self.arena.release()
        self.status.sleep(t.level)


class WeightStatus:
    """Which weights the arena holds, kept where every load reports (``LlamaForCausalLM.load_weights`` calls
    ``before_load`` and ``loaded``). Host only.

    Why an object of its own: the model must not hold its Weights component
    (a reference cycle would keep the arena's owner alive until a collection).
    """

    def __init__(self) -> None:
        self.names: frozenset[str] = frozenset()
        self.missing: set[str] = set()
        self.asleep = 0  # the level the arena sleeps at; 0 while it is placed

    def reset(self, names: frozenset[str]) -> None:
        self.names, self.missing, self.asleep = names, set(names), 0

    def sleep(self, level: int) -> None:
        self.asleep = level
        if level == 2:
            self.missing = set(self.names)

    def wake(self) -> None:
        self.asleep = 0

    def before_load(self) -> None:
        if self.asleep:
            raise EngineSleepingError(f"the weights sleep (level {self.asleep}): their memory is released; call "
                                      "wake_up(['weights']) before loading weights")

    def loaded(self, name: str) -> None:
        self.missing.discard(name)


class HostWeights(Component):
    """The host copy of the weights a level-1 sleep keeps (ledger owner ``host_weights``).

    Owns pinned host memory (plain host memory on the CPU): one buffer the
    size of the arena (``resources.pinned_host_buffer``: exactly sized, and
    its pages go back to the OS when dropped), allocated at the first level-1
    sleep and reused by later ones while ``keep`` (keep_host_buffers);
    dropped at a level-2 sleep, at shutdown, and after each wake when not
    ``keep``.
    After the weights row in the table, so a sleep copies before the device
    buffer goes and a wake copies once it is back.
    """

    owner, tag = "host_weights", WEIGHTS

    def __init__(self, weights: Weights, keep: bool, ledger: ResourceLedger) -> None:
        self._weights, self.keep, self._ledger = weights, keep, ledger
        self.host: torch.Tensor | None = None
        self.last_copy_s = 0.0  # the last host<->device copy alone (bandwidth reports)

    def release(self) -> None:
        if self.host is not None:
            if self.host.is_pinned():
                unpin_host_buffer(self.host)
            self.host = None

    def sleep(self, t: Transition) -> None:
        if t.level == 2:
            self.release()
            return
        arena = self._weights.arena
        if self.host is None:
            host = (pinned_host_buffer(arena.numel, arena.dtype) if arena.device.type == "cuda"
                    else torch.empty(arena.numel, dtype=arena.dtype))
            self.host = self._ledger.track(self.owner, "weights.host", host)
        self._copy(self.host, arena.flat)

    def wake(self, t: Transition) -> None:
        if t.level == 1:
            self._copy(self._weights.arena.flat, self.host)

    def unwake(self, t: Transition) -> None:
        pass  # the copy stays: the weights can only come back from it

    def woken(self, t: Transition) -> None:
        if not self.keep:
            self.release()

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """One non-blocking copy and a single synchronisation."""
        start = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        synchronize(self._weights.device)
        self.last_copy_s = time.perf_counter() - start


class Rope(Component):
    """The model's RoPE cos/sin tables (ledger owner ``rope``): device memory, rebuilt on every wake."""

    owner, tag = "rope", WEIGHTS

    def __init__(self, weights: Weights, ledger: ResourceLedger) -> None:
        self._weights, self._ledger = weights, ledger

    def acquire(self) -> None:
        for i, rotary in enumerate(self._weights.model.rotary_tables()):  # Gemma 3 has a second, local table
            rotary.build(self._weights.device)
            name = "rope" if i == 0 else f"rope{i}"
            self._ledger.track(self.owner, f"{name}.cos", rotary.cos)
            self._ledger.track(self.owner, f"{name}.sin", rotary.sin)

    def release(self) -> None:
        if self._weights.model is not None:
            for rotary in self._weights.model.rotary_tables():
                rotary.release()


class KVCacheRow(Component):
    """The paged KV cache (ledger owner ``kv_cache``), sized by the engine's KVPlan.

    Owns device memory: one tensor for every layer. As one rank of a
    tensor-parallel engine, the first acquire agrees on the block count with
    the other ranks (each planned from its own free memory; a block id must
    mean the same slots everywhere); the agreed count is kept for every wake.
    """

    owner, tag = "kv_cache", KV_CACHE

    def __init__(self, plan: KVPlan, shape: tuple[int, int, int, int], dtype: torch.dtype, device: torch.device,
                 ledger: ResourceLedger, agree: Callable[[int], int] | None = None) -> None:
        self.num_layers, self.block_size, self.num_kv_heads, self.head_dim = shape
        self._plan, self.num_blocks, self._agree = plan, plan.num_blocks, agree
        self.dtype, self.device, self._ledger = dtype, device, ledger
        self.cache: KVCache | None = None

    def acquire(self) -> None:
        if self._agree is not None:
            agreed = self._agree(self.num_blocks)
            check_agreed_blocks(self._plan, agreed, self.block_size)
            self.num_blocks, self._agree = agreed, None
        self.cache = KVCache(self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim,
                             self.dtype, self.device, self._ledger)

    def release(self) -> None:
        self.cache = None


class ProcessGroupRow(Component):
    """This rank's tensor-parallel communicators (ledger owner ``process_group``): kept across sleeps.

    Tracked as an object (its communicator memory is not measured) so that
    shutdown proves it dead like any tensor; destroyed after the step state
    (graphs) that could use it and before the KV cache and weights. A group
    the caller gave (``TPGroup.owns_pg`` False) is the caller's to keep: it
    is neither tracked nor shut down.
    """

    owner, tag = "process_group", None

    def __init__(self, group, rank: int, device: torch.device, ledger: ResourceLedger,
                 before_connect: Callable[[], None] | None = None) -> None:
        self._group, self._rank, self._device, self._ledger = group, rank, device, ledger
        self._before_connect = before_connect

    def acquire(self) -> None:
        if self._before_connect is not None:
            self._before_connect()
        self._group.connect()
        if self._group.owns_pg:
            self._ledger.track(self.owner, f"tp_group.rank{self._rank}", self._group.pg, nbytes=0,
                               device=str(self._device))
        if self._group.control is not None:
            self._ledger.track(self.owner, f"tp_group.rank{self._rank}.control", self._group.control, nbytes=0,
                               device="cpu")

    def release(self) -> None:
        self._group.destroy()


class StepInputsRow(Component):
    """The Triton path's step-input buffers (ledger owners ``inputs``, ``inputs_host``; see StepInputs).

    Owns device memory and a pinned host buffer (unpinned when released). Needs nothing else, but the graphs capture views of it, so it
    sleeps and wakes with them (``STEP``: once weights and KV cache are back).
    """

    owner, tag = "inputs", STEP

    def __init__(self, make: Callable[[], StepInputs]) -> None:
        self._make = make
        self.inputs: StepInputs | None = None

    def acquire(self) -> None:
        self.inputs = self._make()

    def release(self) -> None:
        if self.inputs is not None:
            self.inputs.release()
            self.inputs = None


class CudaGraphsRow(Component):
    """Decode steps captured as CUDA graphs (ledger owner ``cuda_graphs``; see CudaGraphManager).

    Owns device memory: the graphs' pool and outputs. Graphs bake in the
    addresses of the weights, the KV cache and the step buffers, so they come
    last in the table: released first, captured again after every wake
    (without the warm-up runs: kernels compile once per process).

    They need the weights' addresses, not their values: a capture records
    kernels without running them, and every later load (a push, a reload)
    copies into the same arena in place. So after a level-2 wake that only
    allocated the weights the graphs are captured at once, and replay
    whatever the weights hold by the time the runner lets the model run
    (it refuses while any weight is missing).
    """

    owner, tag = "cuda_graphs", STEP

    def __init__(self, sizes: dict[int, tuple[int, ...]], weights: Weights, kv: KVCacheRow, inputs: StepInputsRow,
                 ctx: ForwardContext, ledger: ResourceLedger) -> None:
        self.sizes, self._weights, self._kv, self._inputs = sizes, weights, kv, inputs
        self._ctx, self._ledger = ctx, ledger
        self._warm = False
        self.graphs: CudaGraphManager | None = None

    def acquire(self) -> None:
        graphs = CudaGraphManager(self.sizes, self._inputs.inputs, self._weights.device, self._ledger)
        try:
            graphs.capture(self._weights.model, self._kv.cache, self._ctx, warm_up=not self._warm)
        except BaseException:
            graphs.release()
            raise
        self._warm = True
        self.graphs = graphs

    def release(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
        self.graphs = None

