"""TPDriverRunner: rank 0 of a tensor-parallel engine, the ModelRunner in the user's process.

It runs the same code as every rank (its slice of the weights and KV heads,
the same forward and collectives) and, in addition, drives ranks 1..N-1:
each step's inputs go to the workers as a ``HostBatch`` (plain integer
lists: token ids, positions, slots, block tables) before the driver runs its
own part; the logits are gathered on the driver, which alone samples.
Commands (sleep, wake_up, update_weights, reload_weights, collective_rpc,
shutdown) go to every rank.

Any failure that leaves the ranks out of step (a worker died, a collective
failed) stops the whole group at once: the workers are joined (killed if need
be), the group is destroyed, and every later call raises WorkerError naming
the cause. ``shutdown()`` still works afterwards and releases the driver's
own memory.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import pickle

import torch

from ..config import EngineConfig, ModelConfig
from ..errors import InvalidRequestError, ModelLoadError, ResourceLeakError, WorkerError
from ..loader import ModelSource
from ..model.sharding import TPShard
from ..report import ShutdownReport
from ..resources import drop_traceback_locals
from ..runner.device import resolve_device, synchronize
from ..runner.input_batch import HostBatch
from ..runner.model_runner import ModelRunner, StepLogits, _name_tensor_pairs
from ..runner.rpc import call_on_rank
from .group import TPGroup
from .pool import WorkerPool
from .rank import TPRank, check_rank_count, collective_timeout_s


logger = logging.getLogger("tidyrun")


def check_tensor_parallel_size(world: int, cfg: ModelConfig, device: torch.device) -> None:
    """Refuse a tensor_parallel_size the model or the machine cannot take, before any process starts."""
    check_rank_count(world, cfg)
    if device.type == "cuda" and device.index + world > torch.cuda.device_count():
        raise InvalidRequestError(
            f"tensor_parallel_size={world} needs GPUs {device.index}..{device.index + world - 1} (one per rank), "
            f"but {torch.cuda.device_count()} are visible")


def _rank_device(device: torch.device, rank: int) -> str:
    return "cpu" if device.type == "cpu" else f"cuda:{device.index + rank}"


class TPDriverRunner(ModelRunner):
    """A ModelRunner for rank 0 that also drives the worker ranks.

    Owns device memory through its base (its slice of weights and KV cache,
    tracked by its own ledger) and, besides, the worker processes
    (``pool``) and the group's store server (in ``tp_group``). Each worker's
    runner tracks and releases its own memory; their shutdown reports come
    back as ``worker_reports`` (None for a worker that had died).
    """

    def __init__(self, source: ModelSource, config: EngineConfig, eos_token_ids: frozenset[int]) -> None:
        world = config.tensor_parallel_size
        device = resolve_device(config.device)
        check_tensor_parallel_size(world, source.config, device)
        self._failure: str | None = None
        self.worker_reports: list[ShutdownReport | None] = []
        timeout_s = collective_timeout_s(launched=False)
        group = TPGroup(0, world, device, timeout_s)
        configs = [dataclasses.replace(config, device=_rank_device(device, r)) for r in range(1, world)]
        try:
            self.pool = WorkerPool(world, group.address, configs, eos_token_ids, timeout_s)
        except BaseException:
            group.destroy()
            raise
        tp = TPRank(TPShard.of(source.config, 0, world), group, self.pool.agree_num_blocks)
        try:
            super().__init__(source, config, eos_token_ids, tp=tp)
        except BaseException:
            if getattr(self, "shutdown_report", None) is None:  # refused before its own clean-up (bad config)
                self.pool.kill()
                self.pool.close()
                group.destroy()
            raise
        self.pool.watch(self.tp_group.abort)

    # -- failures --------------------------------------------------------------------

    def _stop_group(self, error: WorkerError) -> WorkerError:
        """Take every rank down after ``error``; later calls raise it again."""
        self._failure = str(error)
        logger.error("tensor-parallel engine stopped: %s", error)
        self.pool.kill()
        self.tp_group.abort()  # NCCL: an orderly shutdown would wait for collectives that cannot finish
        self.tp_group.destroy()
        return error

    def _fail(self, exc: BaseException) -> WorkerError:
        """The error to raise for ``exc``, after stopping every rank (the worker's fault if one failed).

        ``exc`` stays its cause; the locals of its finished frames (the KV
        cache, activations) are cleared so that holding the error keeps no
        device memory alive.
        """
        drop_traceback_locals(exc)
        if isinstance(exc, WorkerError):
            return self._stop_group(exc)
        cause = self.pool.failure()
        return self._stop_group(cause or WorkerError(
            f"a tensor-parallel step failed on the driver ({type(exc).__name__}: {exc}); the ranks are out of step"))

    def _check_usable(self) -> None:
        self._check_alive()
        if self._failure is not None:
            raise WorkerError(f"this tensor-parallel engine has stopped ({self._failure}); "
                              "shut it down and create a new one")

    def check_awake(self) -> None:
        self._check_usable()
        try:
            self.pool.check()
        except WorkerError as exc:
            raise self._stop_group(exc) from None
        super().check_awake()

    def _send(self, msg: tuple) -> None:
        try:
            self.pool.send(msg)
        except WorkerError as exc:
            raise self._stop_group(exc) from None

    def _on_all_ranks(self, op: str, args: tuple, local):
        """Run a command on the workers and ``local()`` here at the same time; returns (local result, worker
        values). The same failure on every rank (a bad argument) is raised as is; a split outcome stops the group."""
        self._check_usable()
        self._send((op, *args))
        try:
            result = local()
        except BaseException as exc:
            replies = self._replies()
            if any(r[0] == "ok" for r in replies):
                raise self._fail(exc) from exc
            raise
        replies = self._replies()
        for rank, reply in enumerate(replies, start=1):
            if reply[0] == "error":
                raise self._stop_group(WorkerError(
                    f"tensor-parallel worker rank {rank} failed to {op}: {reply[1]}: {reply[2]}"))
        return result, [r[1] for r in replies]

    def _replies(self) -> list[tuple]:
        try:
            return self.pool.replies()
        except WorkerError as exc:
            raise self._stop_group(exc) from None

    # -- steps -----------------------------------------------------------------------

    @torch.inference_mode()
    def forward_logits(self, host: HostBatch, graph: tuple[int, int] | None = None,
                       all_rows: bool = False) -> StepLogits | None:
        self.check_awake()
        self._send(("step", host, all_rows))
        try:
            logits = super().forward_logits(host, graph, all_rows)
            synchronize(self.device)  # a collective aborted mid-step leaves garbage: a death during it fails it
            self.pool.check()
        except BaseException as exc:
            raise self._fail(exc) from exc
        return logits

    def embed(self, token_lists: list[list[int]], pooling: str, normalized: bool,
              max_batch_tokens: int) -> torch.Tensor:
        raise InvalidRequestError("embed() and score() (pooling) are not supported with tensor_parallel_size > 1")

    # -- sleep / wake / weights ------------------------------------------------------

    def sleep(self, level: int = 1) -> dict[str, int]:
        """Sleep on every rank; returns the device bytes released by owner, summed over the ranks."""
        freed, others = self._on_all_ranks("sleep", (level,), functools.partial(ModelRunner.sleep, self, level))
        total = dict(freed)
        for other in others:
            for owner, nbytes in other.items():
                total[owner] = total.get(owner, 0) + nbytes
        return total

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._on_all_ranks("wake_up", (tags,), functools.partial(ModelRunner.wake_up, self, tags))

    def reload_weights(self) -> int:
        """Every rank reads its slice of the checkpoint again (see ModelRunner.reload_weights)."""
        count, _ = self._on_all_ranks("reload_weights", (), functools.partial(ModelRunner.reload_weights, self))
        return count

    def update_weights(self, weights) -> int:
        """Full (unsharded) tensors in, each rank keeps its slice: names and shapes are checked here first,
        then every tensor is broadcast to the workers as this rank loads it."""
        self._check_usable()
        self._check_can_update_weights(weights)
        items = list(weights.items()) if hasattr(weights, "items") else list(_name_tensor_pairs(weights))
        refill = "weights" in self.sleeping
        try:
            self.model.check_weights(items, require_all=refill)  # full tensors only: each rank takes its slice
        except ModelLoadError as exc:
            raise InvalidRequestError(f"update_weights: {exc}") from exc
        if self.model.lm_head is None:  # tied head: the checkpoint's copy is skipped on every rank
            items = [(n, t) for n, t in items if n != "lm_head.weight"]
        self._send(("update_weights", [(name, tuple(t.shape)) for name, t in items]))
        try:
            count = ModelRunner.update_weights(self, self._broadcast_each(items))
        except BaseException as exc:
            raise self._fail(exc) from exc
        for rank, reply in enumerate(self._replies(), start=1):
            if reply[0] == "error":
                raise self._stop_group(WorkerError(
                    f"tensor-parallel worker rank {rank} failed to update weights: {reply[1]}: {reply[2]}"))
        return count

    def collective_rpc(self, method, args: tuple, kwargs: dict) -> list:
        """``method`` (checked by ``runner.rpc.check_rpc_method``) on every rank; the results by rank.

        The named methods take the paths that keep the ranks in step
        (``update_weights`` broadcasts each tensor, ``reload_weights`` runs on
        all ranks at once); a function is sent to the workers by pickle (so it
        must be a module-level function) and called with each rank's runner.
        """
        if method == "load_weights":
            return [self.update_weights(*args, **kwargs)] * self.shard.world
        if method == "reload_weights":
            return [self.reload_weights(*args, **kwargs)] * self.shard.world
        try:
            pickle.dumps(method)
        except Exception as exc:
            raise InvalidRequestError(
                f"collective_rpc: with tensor_parallel_size > 1 the function goes to the worker processes and must "
                f"be picklable (a module-level function), but {method!r} is not: {exc}") from exc
        value, others = self._on_all_ranks("rpc", (method, args, kwargs),
                                           functools.partial(call_on_rank, self, method, args, kwargs))
        return [value, *others]

    def _broadcast_each(self, items: list[tuple[str, torch.Tensor]]):
        for name, tensor in items:
            self.tp_group.broadcast(tensor.detach().to(device=self.device, dtype=self.dtype).contiguous())
            yield name, tensor

    # -- shutdown --------------------------------------------------------------------

    def rank_reports(self) -> list[ShutdownReport]:
        """Every rank's shutdown report (a worker that had died has nothing to release: an empty report)."""
        return [self.shutdown_report or ShutdownReport(), *(r or ShutdownReport() for r in self.worker_reports)]

    def shutdown(self, strict: bool = False) -> ShutdownReport:
        """Shut every rank down: the workers and this rank release at the same time, then the workers are
        joined. ``strict`` also raises if a worker reported survivors."""
        if self.shutdown_report is not None:
            return self.shutdown_report
        if self._failure is None and self.pool.started:
            try:
                self.pool.request_shutdown()
            except WorkerError as exc:
                self._failure = str(exc)
        try:
            report = super().shutdown(strict=strict)
        finally:
            self.worker_reports = self.pool.close()
        leaks = [f"rank {rank}: {r}" for rank, r in enumerate(self.worker_reports, start=1) if r and not r.clean]
        if leaks:
            if strict:
                raise ResourceLeakError("\n".join(leaks))
            logger.warning("tensor-parallel workers kept memory after shutdown:\n%s", "\n".join(leaks))
        return report
