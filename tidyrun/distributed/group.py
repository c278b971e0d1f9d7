"""TPGroup: one rank's end of a tensor-parallel process group, outside torch.distributed's global state.

``torch.distributed.init_process_group`` installs one process-wide default
group: two tensor-parallel engines in one process would clash over it, and a
user's own training loop may already own it. A TPGroup instead builds its
process-group object directly on a store (``ProcessGroupGloo`` on the CPU,
``ProcessGroupNCCL`` on CUDA) and calls its collectives itself; nothing is
registered anywhere, so dropping the object is the whole teardown.

Where the store comes from is the only difference between the two ways
ranks start: an engine that spawns its workers hosts a ``TCPStore`` of its
own (rank 0) that they join by address; ranks started by the caller's
launcher (torchrun: ``external.py``) share the launcher's store under a
prefix of their own. A caller may also hand over a process group it built
(``torch.distributed.new_group``): the TPGroup then only runs collectives on
it and never shuts it down.

Teardown order (the runner's shutdown): CUDA graphs and every tensor a
collective may still touch first, then ``destroy()``: the group is shut down
(NCCL: its communicators are freed), then the store goes.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
# Imported here, with tidyrun, for its side effect on lifetimes: torch.distributed.nn.functional's collectives
# take ``group=group.WORLD`` as a default argument, bound when the module is first imported. The engine's
# tokenizer loading imports it (transformers -> FSDP -> torch.distributed.nn); after a trainer's
# init_process_group, that would bind the trainer's default group for good (10 references), keeping it and
# its gloo threads alive past destroy_process_group into interpreter exit, where a thread freeing the last
# collective's tensors needs the GIL and aborts the process ("terminate called without an active
# exception", torch's known gloo-at-exit problem). Imported before the trainer's group exists, the defaults
# are None. tests/test_launcher.py counts the references; 3 ms.
if dist.is_available():
    import torch.distributed.nn  # noqa: F401

from ..errors import WorkerError


class TPGroup:
    """Collectives over the ranks of one tensor-parallel engine.

    Owns communicators (not ledger-tracked tensors): the store (spawned
    ranks: rank 0, the driver, runs its server and picks a free port on
    creation; the workers connect to ``address``; launched ranks: ``store``,
    the launcher's under a prefix) and, after ``connect()``, the process
    group, unless the caller gave one (``pg``: never shut down here). Owns
    no tensor between calls.

    ``every_rank_samples``: ``gather_last_dim`` hands the logits to every
    rank (launched ranks each run the whole engine), not to rank 0 only.
    """

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float,
                 address: tuple[str, int] | None = None, *, store: dist.Store | None = None,
                 pg: dist.ProcessGroup | None = None, every_rank_samples: bool = False) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.every_rank_samples = every_rank_samples
        self.owns_pg = pg is None
        self.pg: dist.ProcessGroup | None = pg
        self.control: dist.ProcessGroup | None = None  # launched NCCL ranks: a gloo group for host-side checks
        self.store: dist.Store | None = store
        self.address = address
        if pg is not None or store is not None:
            return
        if rank == 0:
            self.store = dist.TCPStore("127.0.0.1", 0, world, True, self.timeout, wait_for_workers=False)
            self.address = ("127.0.0.1", self.store.port)
        elif address is None:
            raise ValueError("a worker's TPGroup needs the driver's store address")

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def connect(self) -> None:
        """Rendezvous with the other ranks (every rank calls it) and build the process group (a caller's group
        is connected already)."""
        if not self.owns_pg:
            return
        if self.store is None:
            self.store = dist.TCPStore(self.address[0], self.address[1], self.world, False, self.timeout)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world, options)
            if self.every_rank_samples:
                # Each step's fingerprint goes over gloo on the host first: NCCL work starts only once every
                # rank is in the step, and a rank that is late or gone fails it with an error, where a waiting
                # NCCL collective would end the process at its timeout.
                self.control = dist.ProcessGroupGloo(dist.PrefixStore("control/", self.store), self.rank,
                                                     self.world, self.timeout)
        elif self.address is None:  # launched ranks, maybe on several hosts: this host's interface (as
            # torch.distributed picks it: GLOO_SOCKET_IFNAME, else the host name's address)
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, self.timeout)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = self.timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=self.address[0])]
            self.pg = dist.ProcessGroupGloo(self.store, self.rank, self.world, options)

    def _group(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise WorkerError("the tensor-parallel process group is not connected (destroyed, or never built)")
        return self.pg

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it."""
        self._group().allreduce([t]).wait()
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Overwrite ``t`` on every rank with rank 0's, in place; returns it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._group().broadcast([t], opts).wait()
        return t

    def gather_last_dim(self, t: torch.Tensor, sizes: list[int]) -> torch.Tensor | None:
        """Concatenate every rank's ``t`` along the last dimension on rank 0 (others get None), or on every
        rank (``every_rank_samples``).

        ``sizes[r]`` is rank r's length of that dimension; shorter parts are
        padded to the longest for the collective and trimmed after it.
        """
        width = max(sizes)
        part = (t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))).contiguous()
        receives = self.every_rank_samples or self.rank == 0
        out = [[torch.empty_like(part) for _ in range(self.world)]] if receives else []
        if self.every_rank_samples:
            self._group().allgather(out, [part]).wait()
        else:
            opts = dist.GatherOptions()
            opts.rootRank = 0
            self._group().gather(out, [part], opts).wait()
        if not receives:
            return None
        return torch.cat([o[..., :n] for o, n in zip(out[0], sizes)], dim=-1)

    def all_gather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same count on each), by rank (over the host's gloo group if there is one)."""
        if self.control is not None:
            return all_gather_ints(self.control, values, torch.device("cpu"))
        return all_gather_ints(self._group(), values, self.device)

    def abort(self) -> None:
        """Fail the collectives in flight now (a peer died; called from the pool's watcher thread).

        NCCL waits on a dead peer until its timeout, so its communicators are
        aborted. Gloo needs nothing: a peer's closed connection already fails
        its collectives, and its ``abort`` would not interrupt a waiting one.
        """
        pg = self.pg
        if pg is not None and self.owns_pg and self.backend == "nccl":
            pg.abort()

    def destroy(self) -> None:
        """Shut the group down (a caller's group is only let go) and drop it and the store; idempotent, never
        raises (it runs in shutdown paths)."""
        groups = [self.control, self.pg] if self.owns_pg else []
        self.pg = self.control = None
        for pg in groups:
            if pg is not None:
                try:
                    pg.shutdown()
                except RuntimeError:  # a group whose peer died may refuse an orderly shutdown; dropping it frees it
                    pass
        del groups
        self.store = None


def all_gather_ints(pg: dist.ProcessGroup, values: list[int], device: torch.device) -> list[list[int]]:
    """Every rank's ``values`` (the same count on each) over ``pg``, by rank; ``device``: where ``pg``'s
    backend takes its tensors."""
    part = torch.tensor(values, dtype=torch.int64, device=device)
    out = [[torch.empty_like(part) for _ in range(pg.size())]]
    pg.allgather(out, [part]).wait()
    return [o.tolist() for o in out[0]]
