"""Tensor parallelism: one process per rank, collectives over process groups this package builds itself.

Which slice of the model a rank holds is the model's business
(``tidyrun.model.sharding``); this package runs the ranks:

- ``group``: ``TPGroup``, a store and a gloo/NCCL process group outside torch.distributed's global state;
- ``rank``: ``TPRank``, what a ModelRunner needs to be one rank;
- ``worker``: the worker process (ranks 1..N-1): a ModelRunner serving the driver's commands;
- ``pool``: ``WorkerPool``, the driver's side of the workers: spawn, commands, crash detection, teardown;
- ``driver``: ``TPDriverRunner``, rank 0: the ModelRunner in the user's process that drives the others;
- ``external``: ``LaunchedRankRunner``, one rank of an engine whose ranks the caller's launcher (torchrun)
  started, each process running the whole engine (``distributed_executor_backend="external_launcher"``).

Both ways of starting share the rank code: every rank is a ModelRunner built with a ``TPRank``.
Submodules are imported where used (the engine imports ``driver`` and ``external``), so
importing this package pulls in nothing.
"""
