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

Failures: a rank that fails to start posts why on the store before it
raises (start-up goes in rounds: KV cache size, rendezvous, ready), and the
others, waiting in that round, raise it naming that rank. A collective that
fails mid-step stops this rank's engine; every later call raises WorkerError
until it is shut down. Each step starts with a fingerprint of its inputs
all-gathered over gloo on the host (on CUDA too), so a peer that died is
seen at once, and a late one within the collective timeout (1800 s, or
``TIDYRUN_COLLECTIVE_TIMEOUT_S``); a peer that dies inside an NCCL
collective ends this process at that timeout (torch's NCCL watchdog).

Without torchrun's agent, rank 0's engine hosts the store: build and shut
down engines in step on every rank (as the calls must be anyway).
"""

from __future__ import annotations

import dataclasses
import datetime
import os

import torch
import torch.distributed as dist

from ..config import EngineConfig
from ..errors import InvalidRequestError, OutOfResourcesError, WorkerError
from ..loader import ModelSource
from ..model.sharding import TPShard
from ..resources import drop_traceback_locals
from ..runner.device import resolve_device
from ..runner.input_batch import HostBatch
from ..runner.model_runner import ModelRunner, StepLogits
from ..runner.rpc import call_on_rank
from .group import TPGroup, all_gather_ints
from .rank import TPRank, check_rank_count, collective_timeout_s

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
    """The device named in the config; unnamed (or "cuda"), the launcher's GPU for this process (LOCAL_RANK;
    the one visible GPU when the launcher gives each process one)."""
    if config.device in (None, "cuda") and torch.cuda.is_available() and local_rank is not None:
        count = torch.cuda.device_count()
        if local_rank >= count and count != 1:
            raise InvalidRequestError(f"LOCAL_RANK={local_rank}, but {count} GPUs are visible")
        return torch.device("cuda", local_rank if local_rank < count else 0)
    return resolve_device(config.device)


def _agreed_blocks(votes: list[tuple[int, int]], block_size: int) -> int:
    """The least block count of all ranks, checked against the longest sequence any rank planned for, so that
    every rank accepts it or every rank refuses it with the same error."""
    agreed = min(blocks for blocks, _ in votes)
    rank, needed = max(enumerate(n for _, n in votes), key=lambda x: x[1])
    if agreed < needed:
        raise OutOfResourcesError(
            f"the tensor-parallel ranks agreed on {agreed} KV blocks ({agreed * block_size} tokens), fewer than "
            f"one sequence of rank {rank}'s max_model_len needs ({needed} blocks); another rank planned fewer "
            "blocks (a smaller device): lower max_model_len or raise gpu_memory_utilization on every rank")
    return agreed


class StoreStartup:
    """Start-up over the store, in three rounds every rank posts to: "start" (its KV block count and the
    blocks one sequence needs, once its weights are loaded; all ranks take the least count), "connect" (its
    KV cache is allocated; next is the group's rendezvous) and "ready" (its runner is built). A rank that
    fails posts why in the round it is in, and the others, waiting for every post (up to the timeout),
    raise it naming that rank, so no rank waits in a rendezvous or a collective for one that will not come."""

    ROUNDS = ("start", "connect", "ready")

    def __init__(self, store: dist.Store, rank: int, world: int, first_global: int,
                 timeout: datetime.timedelta) -> None:
        self.store, self.rank, self.world, self.timeout = store, rank, world, timeout
        self.first_global = first_global  # the launcher's RANK of this engine's rank 0
        self.round = 0  # the next round this rank posts to

    def _name(self, r: int) -> str:
        return f"tensor-parallel rank {r} (launcher RANK {self.first_global + r})"

    def _round(self, value: str) -> list[str]:
        """Post ``value`` in this rank's next round, then every rank's post in it."""
        name = self.ROUNDS[self.round]
        self.round += 1
        self.store.set(f"{name}/{self.rank}", f"ok {value}")
        values = []
        for r in range(self.world):
            key = f"{name}/{r}"
            try:
                self.store.wait([key], self.timeout)
                status, _, got = self.store.get(key).decode().partition(" ")
            except (RuntimeError, dist.DistError) as exc:
                raise WorkerError(f"{self._name(r)} did not finish starting within "
                                  f"{self.timeout.total_seconds():.0f} s, or the launcher's store is gone "
                                  f"({type(exc).__name__}); this is {self._name(self.rank)}") from None
            if status != "ok":
                raise WorkerError(f"{self._name(r)} failed to start: {got}")
            values.append(got)
        return values

    def agree(self, local: int, needed: int, block_size: int) -> int:
        votes = [tuple(int(x) for x in v.split()) for v in self._round(f"{local} {needed}")]
        return _agreed_blocks(votes, block_size)

    def connect(self) -> None:
        self._round("")

    def ready(self) -> None:
        self._round("")

    def fail(self, why: str) -> None:
        """Tell the other ranks, in the round they wait in, that this one will not start."""
        if self.round < len(self.ROUNDS):
            try:
                self.store.set(f"{self.ROUNDS[self.round]}/{self.rank}", f"error {why}")
            except (RuntimeError, dist.DistError):  # the store is gone: the others time out instead
                pass
            self.round = len(self.ROUNDS)


class GroupStartup:
    """The same rounds over a caller's process group (which exists already), one all-gather of (started,
    block count, blocks needed) each; a rank that failed joins the round it is in with its failure. Holds
    the caller's group itself: the runner's TPGroup lets go of it when a failed start shuts the runner down."""

    ROUNDS = 3

    def __init__(self, pg: dist.ProcessGroup, device: torch.device) -> None:
        self.pg, self.device = pg, device
        self.round = 0

    def _vote(self, ok: bool, blocks: int = 0, needed: int = 0) -> list[tuple[int, int]]:
        self.round += 1
        votes = all_gather_ints(self.pg, [int(ok), blocks, needed], self.device)
        failed = [r for r, v in enumerate(votes) if not v[0]]
        if failed:
            self.round = self.ROUNDS  # every rank saw it: nobody votes again (a vote nobody joins would hang)
            if ok:
                raise WorkerError(f"tensor-parallel rank(s) {failed} of the caller's process group failed to "
                                  "start (their own error says why)")
        return [(v[1], v[2]) for v in votes]

    def agree(self, local: int, needed: int, block_size: int) -> int:
        votes = self._vote(True, local, needed)
        try:
            return _agreed_blocks(votes, block_size)
        except OutOfResourcesError:
            self.round = self.ROUNDS  # refused alike on every rank
            raise

    def connect(self) -> None:
        self._vote(True)

    def ready(self) -> None:
        try:
            self._vote(True)
        finally:
            self.pg = None  # the rounds are over: the caller's group is the caller's again (see fail)

    def fail(self, why: str) -> None:
        if self.round < self.ROUNDS:
            try:
                self._vote(False)
            except RuntimeError:
                pass
            self.round = self.ROUNDS
        # Let go of the caller's group: the runner's table keeps this object (its ``connect``) until the
        # runner is collected, and a group still referenced when the caller destroys it keeps its gloo
        # threads running into interpreter exit, where one freeing a finished collective's tensors aborts
        # the process ("terminate called without an active exception").
        self.pg = None


@dataclasses.dataclass(frozen=True)
class LaunchedRank:
    """This process's place in a launched engine, found before the model is opened (so that any failure
    to start after it is told to the other ranks): its config (device set), its group (not connected yet)
    and the start-up rounds."""

    config: EngineConfig
    group: TPGroup
    startup: StoreStartup | GroupStartup

    def fail(self, exc: BaseException) -> None:
        self.startup.fail(f"{type(exc).__name__}: {exc}")
        self.group.destroy()


def join_launch(config: EngineConfig, process_group=None) -> LaunchedRank:
    """Find this process's rank, device and group from the launcher's environment (or ``process_group``)."""
    world = config.tensor_parallel_size
    timeout_s = collective_timeout_s(launched=True)
    timeout = datetime.timedelta(seconds=timeout_s)
    if process_group is not None:
        if not isinstance(process_group, dist.ProcessGroup):
            raise InvalidRequestError(f"process_group must be a torch.distributed ProcessGroup, got "
                                      f"{type(process_group).__name__}")
        if process_group.size() != world:
            raise InvalidRequestError(f"process_group has {process_group.size()} ranks but tensor_parallel_size="
                                      f"{world}: the group must hold exactly the ranks of this engine")
        local = os.environ.get("LOCAL_RANK")
        device = _launched_device(config, None if local is None else int(local))
        group = TPGroup(process_group.rank(), world, device, timeout_s, pg=process_group, every_rank_samples=True)
        startup = GroupStartup(process_group, device)
    else:
        launch = Launch.from_env()
        if launch.world % world:
            raise InvalidRequestError(f"the launcher started {launch.world} processes, which tensor_parallel_size="
                                      f"{world} does not divide: each {world} consecutive ranks form one engine")
        device = _launched_device(config, launch.local_rank)
        store = launch.store(timeout)
        # Keys of this engine only: the n-th engine this process builds meets the n-th of every other rank
        # (counted here, before anything that could fail on one rank only).
        generation = store.add(f"tidyrun/engines/rank{launch.rank}", 1)
        first = launch.rank - launch.rank % world
        store = dist.PrefixStore(f"tidyrun/engine{generation}/ranks{first}-{first + world - 1}/", store)
        group = TPGroup(launch.rank % world, world, device, timeout_s, store=store, every_rank_samples=True)
        startup = StoreStartup(store, group.rank, world, first, timeout)
    if device.type == "cuda":
        # This process's kernels (Triton launches on the current device) run on its rank's GPU, as spawned
        # workers' do; vLLM's external launcher sets it the same way.
        torch.cuda.set_device(device)
    return LaunchedRank(dataclasses.replace(config, device=str(device)), group, startup)


class LaunchedRankRunner(ModelRunner):
    """One rank of a tensor-parallel engine whose ranks the caller's launcher started (see the module).

    Owns device memory through its base (its slice of the weights and the KV
    cache, its own ledger) and its process group (unless the caller gave it).
    Sleep, wake_up, update_weights and reload_weights are the base's, run
    by every rank itself when the user calls them on every rank; pushed
    weights may be full tensors or this rank's slice of them.
    """

    accepts_rank_slices = True

    def __init__(self, source: ModelSource, launched: LaunchedRank, eos_token_ids: frozenset[int]) -> None:
        self._failure: str | None = None
        config, group = launched.config, launched.group
        check_rank_count(config.tensor_parallel_size, source.config)
        startup, block = launched.startup, config.cache.block_size

        def agree(local: int) -> int:  # runs once the KV plan exists: it also says what one sequence needs
            return startup.agree(local, -(-self.kv_plan.max_model_len // block), block)

        tp = TPRank(TPShard.of(source.config, group.rank, group.world), group, agree, startup.connect)
        super().__init__(source, config, eos_token_ids, tp=tp)  # a failure here: the engine tells the others
        try:
            launched.startup.ready()
        except BaseException as exc:  # another rank failed after the block agreement: give back what we took
            drop_traceback_locals(exc)
            self.shutdown()
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
        also = "" if self.tp_group.owns_pg else "; the process_group you gave may be out of step too: rebuild it"
        return WorkerError(f"tensor-parallel rank {self.shard.rank} of {self.shard.world} stopped: {why}{also}")

    def _check_same_step(self, host: HostBatch, all_rows: bool) -> None:
        """All ranks must run the same batch (the same calls in the same order); compare a fingerprint."""
        mine = [len(host.input_ids), hash((tuple(host.input_ids), tuple(host.positions), tuple(host.slots),
                                           tuple(host.logits_indices), tuple(host.seq_lens),
                                           tuple(host.query_lens), tuple(map(tuple, host.tables)), all_rows))]
        every = self.tp_group.all_gather_ints(mine)
        if any(v != mine for v in every):
            sizes = [v[0] for v in every]
            what = (", ".join(f"rank {r}: {n} tokens" for r, n in enumerate(sizes)) if len(set(sizes)) > 1
                    else f"{sizes[0]} tokens on every rank, but not the same tokens, positions or rows")
            raise self._stop(
                f"the ranks' steps differ ({what}): every rank must make the same calls (generate() with the same "
                "prompts and sampling params, sleep, wake_up, ...) in the same order")

    @torch.inference_mode()
    def forward_logits(self, host: HostBatch, graph: tuple[int, int] | None = None,
                       all_rows: bool = False) -> StepLogits | None:
        self.check_awake()
        try:
            self._check_same_step(host, all_rows)
            return super().forward_logits(host, graph, all_rows)
        except WorkerError:
            raise
        except Exception as exc:
            drop_traceback_locals(exc)  # the step's activations and the KV cache must not live on in it
            raise self._stop(f"a step failed ({type(exc).__name__}: {exc}); the ranks are out of step (a peer "
                             "rank died or left, or this rank failed)") from exc
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
