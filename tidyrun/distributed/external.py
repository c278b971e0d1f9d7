"""Ranks the caller launched: vLLM's ``distributed_executor_backend="external_launcher"``.

An RL trainer started by torchrun (one process per GPU, on one node or
several) builds an engine in every process. With ``tensor_parallel_size=N``
each N consecutive ranks (``RANK // N``) form one tensor-parallel engine, and
every rank runs the whole engine: scheduler, sampling and detokenizing, on
the same prompts and sampling params, which every rank must pass in the same
order (as vLLM requires). Each holds its slice of the weights and KV heads
through the same ModelRunner a spawned worker runs; the logits are
all-gathered, so every rank samples the same tokens from the same bytes with
the same seeded generators. Each step first checks that the ranks run the
same batch: ranks whose calls differ fail with an error that says so, instead
of hanging in a collective or sampling from garbage.

Rendezvous goes through the launcher's own store (torchrun's agent store, or
the env:// contract: rank 0 hosts it at MASTER_ADDR:MASTER_PORT), under a
prefix of this engine's own; ranks on other nodes reach each other through it
and gloo/NCCL, nothing of ours. The process group is the engine's own,
built outside torch.distributed's global state, so the default group stays
the trainer's, untouched. A caller may instead pass a group it built
(``process_group=torch.distributed.new_group(...)``).

Failures: a rank that fails to start publishes why on the store before it
raises, and the others, waiting to agree on the KV cache size, raise it
naming that rank. A collective that fails mid-step (a peer died: gloo sees
its connection close at once; NCCL waits for the collective timeout) stops
this rank's engine; every later call raises WorkerError until it is shut down.
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..errors import InvalidRequestError, WorkerError
from ..loader import ModelSource
from ..model.sharding import TPShard
from ..resources import drop_traceback_locals
from ..runner.device import resolve_device
from ..runner.input_batch import HostBatch
from ..runner.model_runner import ModelRunner, StepLogits
from ..runner.rpc import call_on_rank
from .group import TPGroup
from .rank import COLLECTIVE_TIMEOUT_S, TPRank, check_rank_count

LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where this process stands among the launcher's processes (torchrun's environment variables)."""

    rank: int
    world: int
    local_rank: int | None
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store (every process is a client)

    @classmethod
    def from_env(cls) -> Launch:
        missing = [name for name in LAUNCHER_ENV if not os.environ.get(name)]
        if missing:
            raise InvalidRequestError(
                f"distributed_executor_backend='external_launcher' joins the processes of a launcher such as "
                f"torchrun, which sets {', '.join(LAUNCHER_ENV)}; {', '.join(missing)} not set here. Start the "
                f"script with torchrun, pass process_group= (a torch.distributed group of your own), or leave "
                f"the backend out (the engine then spawns its ranks)")
        try:
            local = os.environ.get("LOCAL_RANK")
            launch = cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None if local is None else int(local),
                         os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                         os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True")
        except ValueError as exc:
            raise InvalidRequestError(f"the launcher's environment is malformed: {exc}") from None
        if not 0 < launch.master_port < 2**16:  # torchrun --master-port 0 passes 0 on, where nothing listens
            raise InvalidRequestError(f"MASTER_PORT={launch.master_port} is not a port the store can listen on: "
                                      "give the launcher a fixed port (torchrun --master-port N, N > 0)")
        return launch

    def store(self, timeout: datetime.timedelta) -> dist.Store:
        """A client of the launcher's store (rank 0 hosts it when no torchrun agent does; multi-tenant, so a
        trainer's ``init_process_group`` in the same process shares the server)."""
        host = self.rank == 0 and not self.agent_store
        try:
            return dist.TCPStore(self.master_addr, self.master_port, None, host, timeout, wait_for_workers=False,
                                 multi_tenant=True)
        except (RuntimeError, dist.DistError) as exc:
            raise WorkerError(f"tensor-parallel rank {self.rank}: cannot reach the launcher's store at "
                              f"{self.master_addr}:{self.master_port}: {exc}") from None


def _launched_device(config: EngineConfig, local_rank: int | None) -> torch.device:
    """The device named in the config; unnamed (or "cuda"), the launcher's GPU for this process (LOCAL_RANK)."""
    if config.device in (None, "cuda") and torch.cuda.is_available() and local_rank is not None:
        if local_rank >= torch.cuda.device_count():
            raise InvalidRequestError(f"LOCAL_RANK={local_rank}, but {torch.cuda.device_count()} GPUs are visible")
        return torch.device("cuda", local_rank)
    return resolve_device(config.device)


class StoreStartup:
    """The ranks' agreement on the KV block count, over the store: each rank posts its count, or why it
    failed to start; each then waits for every post (up to the timeout) and takes the least count."""

    def __init__(self, store: dist.Store, rank: int, world: int, timeout: datetime.timedelta) -> None:
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.posted = False

    def agree(self, local: int) -> int:
        self.posted = True
        self.store.set(f"start/{self.rank}", f"ok {local}")
        counts = []
        for r in range(self.world):
            key = f"start/{r}"
            try:
                self.store.wait([key], self.timeout)
            except (RuntimeError, dist.DistError):
                raise WorkerError(f"tensor-parallel rank {r} did not finish starting within "
                                  f"{self.timeout.total_seconds():.0f} s (this is rank {self.rank})") from None
            status, _, value = self.store.get(key).decode().partition(" ")
            if status != "ok":
                raise WorkerError(f"tensor-parallel rank {r} failed to start: {value}")
            counts.append(int(value))
        return min(counts)

    def fail(self, why: str) -> None:
        """Tell the other ranks this one will not start (unless it already agreed: then they have moved on)."""
        if not self.posted:
            self.posted = True
            try:
                self.store.set(f"start/{self.rank}", f"error {why}")
            except (RuntimeError, dist.DistError):  # the store is gone: the others time out instead
                pass


class GroupStartup:
    """The same agreement over a caller's process group (which exists already): one all-gather of
    (started, block count); a rank that failed to start joins it with its failure."""

    def __init__(self, group: TPGroup) -> None:
        self.group = group
        self.posted = False

    def _vote(self, started: bool, local: int) -> list[list[int]]:
        self.posted = True
        return self.group.all_gather_ints([int(started), local])

    def agree(self, local: int) -> int:
        votes = self._vote(True, local)
        failed = [r for r, (started, _) in enumerate(votes) if not started]
        if failed:
            raise WorkerError(f"tensor-parallel rank(s) {failed} of the caller's process group failed to start "
                              "(their own error says why)")
        return min(count for _, count in votes)

    def fail(self, why: str) -> None:
        if not self.posted:
            try:
                self._vote(False, 0)
            except RuntimeError:
                pass


def launched_rank(config: EngineConfig, source: ModelSource, process_group=None):
    """(this rank's config with its device, its TPRank, its start-up agreement) for a launched engine."""
    world = config.tensor_parallel_size
    timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise InvalidRequestError(f"process_group must be a torch.distributed ProcessGroup, got "
                                      f"{type(process_group).__name__}")
        if process_group.size() != world:
            raise InvalidRequestError(f"process_group has {process_group.size()} ranks but tensor_parallel_size="
                                      f"{world}: the group must hold exactly the ranks of this engine")
        local = os.environ.get("LOCAL_RANK")
        device = _launched_device(config, None if local is None else int(local))
        group = TPGroup(process_group.rank(), world, device, COLLECTIVE_TIMEOUT_S, pg=process_group,
                        every_rank_samples=True)
        startup = GroupStartup(group)
    else:
        launch = Launch.from_env()
        if launch.world % world:
            raise InvalidRequestError(f"the launcher started {launch.world} processes, which tensor_parallel_size="
                                      f"{world} does not divide: each {world} consecutive ranks form one engine")
        device = _launched_device(config, launch.local_rank)
        store = launch.store(timeout)
        # Keys of this engine only: the n-th engine this process builds meets the n-th of every other rank.
        generation = store.add(f"tidyrun/engines/rank{launch.rank}", 1)
        store = dist.PrefixStore(f"tidyrun/engine{generation}/group{launch.rank // world}/", store)
        group = TPGroup(launch.rank % world, world, device, COLLECTIVE_TIMEOUT_S, store=store,
                        every_rank_samples=True)
        startup = StoreStartup(store, group.rank, world, timeout)
    config = dataclasses.replace(config, device=str(device))
    return config, TPRank(TPShard.of(source.config, group.rank, world), group, startup.agree), startup


class LaunchedRankRunner(ModelRunner):
    """One rank of a tensor-parallel engine whose ranks the caller's launcher started (see the module).

    Owns device memory through its base (its slice of the weights and the KV
    cache, its own ledger) and its process group (unless the caller gave it).
    Sleep, wake_up, update_weights and reload_weights are the base's, run
    by every rank itself when the user calls them on every rank.
    """

    def __init__(self, source: ModelSource, config: EngineConfig, eos_token_ids: frozenset[int],
                 process_group=None) -> None:
        self._failure: str | None = None
        check_rank_count(config.tensor_parallel_size, source.config)
        config, tp, startup = launched_rank(config, source, process_group)
        try:
            super().__init__(source, config, eos_token_ids, tp=tp)
        except BaseException as exc:
            startup.fail(f"{type(exc).__name__}: {exc}")
            tp.group.destroy()
            raise

    def _check_usable(self) -> None:
        self._check_alive()
        if self._failure is not None:
            raise WorkerError(f"this tensor-parallel rank has stopped ({self._failure}); shut it down and "
                              "create a new engine on every rank")

    def check_awake(self) -> None:
        self._check_usable()
        super().check_awake()

    def _stop(self, why: str) -> WorkerError:
        self._failure = why
        self.tp_group.abort()
        self.tp_group.destroy()
        return WorkerError(f"tensor-parallel rank {self.shard.rank} of {self.shard.world} stopped: {why}")

    def _check_same_step(self, host: HostBatch) -> None:
        """All ranks must run the same batch (the same calls in the same order); compare a fingerprint."""
        mine = [len(host.input_ids), hash((tuple(host.input_ids), tuple(host.positions), tuple(host.slots),
                                           tuple(host.logits_indices)))]
        every = self.tp_group.all_gather_ints(mine)
        if any(v != mine for v in every):
            sizes = [v[0] for v in every]
            what = (", ".join(f"rank {r}: {n} tokens" for r, n in enumerate(sizes)) if len(set(sizes)) > 1
                    else f"{sizes[0]} tokens on every rank, but not the same tokens or positions")
            raise self._stop(
                f"the ranks' steps differ ({what}): every rank must make the same calls (generate() with the same "
                "prompts and sampling params, sleep, wake_up, ...) in the same order")

    @torch.inference_mode()
    def forward_logits(self, host: HostBatch, graph: tuple[int, int] | None = None,
                       all_rows: bool = False) -> StepLogits | None:
        self.check_awake()
        try:
            self._check_same_step(host)
            return super().forward_logits(host, graph, all_rows)
        except WorkerError:
            raise
        except Exception as exc:
            drop_traceback_locals(exc)  # the step's activations and the KV cache must not live on in it
            raise self._stop(f"a step failed ({type(exc).__name__}: {exc}); a peer rank died or left, "
                             "and the ranks are out of step") from exc
        except BaseException as exc:  # Ctrl-C mid-step: the ranks are out of step, but the interrupt stays one
            drop_traceback_locals(exc)
            self._stop(f"interrupted mid-step ({type(exc).__name__})")
            raise

    def embed(self, token_lists: list[list[int]], pooling: str, normalized: bool,
              max_batch_tokens: int) -> torch.Tensor:
        raise InvalidRequestError("embed() and score() (pooling) are not supported with tensor_parallel_size > 1")

    def collective_rpc(self, method, args: tuple, kwargs: dict) -> list:
        """``method`` on this rank's runner only (every rank calls it itself); a list of its one result, as
        vLLM's external launcher returns."""
        self._check_usable()
        return [call_on_rank(self, method, args, kwargs)]
