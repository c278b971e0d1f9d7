"""TPGroup: one rank's end of a tensor-parallel process group, outside torch.distributed's global state.

``torch.distributed.init_process_group`` installs one process-wide default
group: two tensor-parallel engines in one process would clash over it, and a
user's own training loop may already own it. A TPGroup instead builds its
store and its process-group object directly (``TCPStore`` +
``ProcessGroupGloo`` on the CPU, ``ProcessGroupNCCL`` on CUDA) and calls
their collectives itself; nothing is registered anywhere, so dropping the
object is the whole teardown.

Teardown order (the runner's shutdown): CUDA graphs and every tensor a
collective may still touch first, then ``destroy()``: the group is shut down
(NCCL: its communicators are freed), then the store goes.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..errors import WorkerError


class TPGroup:
    """Collectives over the ranks of one tensor-parallel engine.

    Owns communicators (not ledger-tracked tensors): the TCP store (rank 0,
    the driver, runs its server and picks a free port on creation; the
    workers connect to ``address``) and, after ``connect()``, the process
    group. Owns no tensor between calls.
    """

    def __init__(self, rank: int, world: int, device: torch.device, timeout_s: float,
                 address: tuple[str, int] | None = None) -> None:
        self.rank, self.world, self.device = rank, world, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.pg: dist.ProcessGroup | None = None
        self.store: dist.Store | None = None
        if rank == 0:
            self.store = dist.TCPStore("127.0.0.1", 0, world, True, self.timeout, wait_for_workers=False)
            self.address = ("127.0.0.1", self.store.port)
        elif address is None:
            raise ValueError("a worker's TPGroup needs the driver's store address")
        else:
            self.address = address

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"

    def connect(self) -> None:
        """Rendezvous with the other ranks (every rank calls it) and build the process group."""
        if self.store is None:
            self.store = dist.TCPStore(self.address[0], self.address[1], self.world, False, self.timeout)
        if self.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world, options)
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
        """Concatenate every rank's ``t`` along the last dimension on rank 0 (others get None).

        ``sizes[r]`` is rank r's length of that dimension; shorter parts are
        padded to the longest for the collective and trimmed after it.
        """
        width = max(sizes)
        part = t if t.shape[-1] == width else torch.nn.functional.pad(t, (0, width - t.shape[-1]))
        opts = dist.GatherOptions()
        opts.rootRank = 0
        out = [[torch.empty_like(part) for _ in range(self.world)]] if self.rank == 0 else []
        self._group().gather(out, [part.contiguous()], opts).wait()
        if self.rank != 0:
            return None
        return torch.cat([o[..., :n] for o, n in zip(out[0], sizes)], dim=-1)

    def abort(self) -> None:
        """Fail the collectives in flight now (a peer died; called from the pool's watcher thread).

        NCCL waits on a dead peer until its timeout, so its communicators are
        aborted. Gloo needs nothing: a peer's closed connection already fails
        its collectives, and its ``abort`` would not interrupt a waiting one.
        """
        pg = self.pg
        if pg is not None and self.backend == "nccl":
            pg.abort()

    def destroy(self) -> None:
        """Shut the group down and drop it and the store; idempotent, never raises (it runs in shutdown paths)."""
        pg, self.pg = self.pg, None
        if pg is not None:
            try:
                pg.shutdown()
            except RuntimeError:  # a group whose peer died may refuse an orderly shutdown; dropping it still frees it
                pass
        del pg
        self.store = None
