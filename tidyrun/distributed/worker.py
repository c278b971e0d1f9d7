"""The tensor-parallel worker process: one rank's ModelRunner, serving the driver's commands.

The driver (rank 0) sends commands over a pipe: ``("step", HostBatch,
all_rows)`` runs the forward and its collectives (no reply: the driver
receives the gathered logits through the group), ``("sleep", level)``,
``("wake_up", tags)``, ``("update_weights", [(name, shape)])`` (the tensors
follow as broadcasts over the group), ``("reload_weights",)`` (each rank reads
its slice of the checkpoint), ``("rpc", function, args, kwargs)``
(collective_rpc) and ``("shutdown",)`` answer
``("ok", value)`` or ``("error", type name, message)``. A failed step or
weight update leaves the ranks out of step, so the worker reports it and
exits; the driver turns that into an error. A worker also exits when the
driver is gone: its pipe closes, or its parent process changes.
"""

from __future__ import annotations

import os
import pickle
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection

import torch

from ..config import EngineConfig
from ..errors import WorkerError
from ..model.sharding import TPShard
from ..runner.rpc import call_on_rank
from .group import TPGroup
from .rank import TPRank

_PARENT_CHECK_S = 1.0  # how often an idle worker checks that its driver still exists


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its rank (picklable: it crosses the spawn)."""

    rank: int
    world: int
    address: tuple[str, int]  # the driver's store
    config: EngineConfig  # device set to this rank's device
    eos_token_ids: frozenset[int]
    timeout_s: float
    parent_pid: int


def _error(exc: BaseException) -> tuple[str, str, str]:
    return ("error", type(exc).__name__, str(exc))


def _reply(conn: Connection, msg: tuple) -> bool:
    """Send ``msg`` to the driver; False if the driver is gone (then there is nobody left to serve)."""
    try:
        conn.send(msg)
    except OSError:
        return False
    return True


def _next_command(conn: Connection, parent_pid: int) -> tuple | None:
    """The driver's next command, or None once the driver is gone."""
    while not conn.poll(_PARENT_CHECK_S):
        if os.getppid() != parent_pid:
            return None
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _agree(conn: Connection, parent_pid: int, local: int) -> int:
    conn.send(("ready", local))
    msg = _next_command(conn, parent_pid)
    if msg is None or msg[0] != "blocks":
        raise WorkerError("the driver stopped before the tensor-parallel engine finished starting")
    return msg[1]


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """Entry point of a worker process: build this rank's runner, then serve commands until shutdown."""
    from ..loader import open_engine_source
    from ..runner.model_runner import ModelRunner

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the driver decides
    try:
        device = torch.device(spec.config.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)  # this process's own default device: it serves one rank only
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world))  # share the cores with the other ranks
        source = open_engine_source(spec.config)
        group = TPGroup(spec.rank, spec.world, device, spec.timeout_s, spec.address)
        tp = TPRank(TPShard.of(source.config, spec.rank, spec.world), group,
                    lambda n: _agree(conn, spec.parent_pid, n))
        runner = ModelRunner(source, spec.config, spec.eos_token_ids, tp=tp)
    except BaseException as exc:  # the runner released what it took; report why and end
        _reply(conn, _error(exc))
        return
    orderly = False
    try:
        orderly = _serve(runner, conn, spec.parent_pid)
    finally:
        if not orderly:
            # The driver is gone or the ranks are out of step: a collective of ours may wait on a peer
            # that will never join, and shutdown's device synchronize would wait with it (NCCL has no
            # peer-death check; its watchdog fires only after the timeout). Abort the group first.
            runner.tp_group.abort()
        runner.shutdown()
        conn.close()


def _serve(runner, conn: Connection, parent_pid: int) -> bool:
    """Run the driver's commands; True once it asked for an orderly shutdown, False if it vanished or the
    ranks fell out of step."""
    while (msg := _next_command(conn, parent_pid)) is not None:
        op, args = msg[0], msg[1:]
        if op == "shutdown":
            _reply(conn, ("ok", runner.shutdown()))
            return True
        try:
            value = _run(runner, op, args)
        except BaseException as exc:
            if not _reply(conn, _error(exc)) or op in ("step", "update_weights"):
                return False  # the ranks are out of step (or the driver is gone): end, so no collective waits on us
            continue
        if op != "step" and not _reply(conn, ("ok", value)):
            return False
    return False


def _run(runner, op: str, args: tuple):
    if op == "step":
        return runner.forward_logits(args[0], None, args[1])
    if op == "sleep":
        return runner.sleep(*args)
    if op == "wake_up":
        return runner.wake_up(*args)
    if op == "update_weights":
        return runner.update_weights(_received_weights(runner, args[0]))
    if op == "reload_weights":
        return runner.reload_weights()
    if op == "rpc":  # collective_rpc with a function: (function, args, kwargs)
        value = call_on_rank(runner, *args)
        try:
            pickle.dumps(value)
        except Exception as exc:  # would fail the reply itself, and end this worker
            raise WorkerError(f"collective_rpc: the function's result on rank {runner.shard.rank} cannot be sent "
                              f"back (not picklable): {exc}") from None
        return value
    raise WorkerError(f"unknown tensor-parallel command {op!r}")


def _received_weights(runner, specs: list[tuple[str, tuple[int, ...]]]):
    """(name, tensor) pairs as the driver broadcasts them, one tensor at a time."""
    for name, shape in specs:
        yield name, runner.tp_group.broadcast(torch.empty(shape, dtype=runner.dtype, device=runner.device))
