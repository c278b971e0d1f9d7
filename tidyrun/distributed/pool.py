"""WorkerPool: the driver's side of the tensor-parallel worker processes (ranks 1..N-1).

Every wait on a worker is a wait on two things at once, its pipe and its
process sentinel (``multiprocessing.connection.wait``), with a timeout: a
worker that crashes or is killed turns into ``WorkerDiedError`` naming its
rank, pid and exit code (and the error it reported, if it had time to), never
into a hang. A watcher thread also notices a death the moment it happens, for
collectives that would not (NCCL waits on a dead peer until its timeout).
Teardown always ends with every process joined: asked to shut down, then
terminated, then killed.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait

import torch.multiprocessing as mp

from ..config import EngineConfig
from ..errors import WorkerDiedError, WorkerError
from .worker import WorkerSpec, run_worker

START_TIMEOUT_S = 600.0  # a worker opening the model and loading its slice
REPLY_TIMEOUT_S = 600.0  # sleep / wake_up / reload_weights (re-reads the weights) / update_weights
EXIT_TIMEOUT_S = 30.0  # each phase of a shutdown: report, join, terminate

logger = logging.getLogger("tidyrun")


@dataclass
class _Worker:
    rank: int
    process: mp.Process
    conn: Connection


def _exit_description(code: int | None) -> str:
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"exited with code {code}"
    return f"exited with code {code}"


class WorkerPool:
    """The worker processes of one tensor-parallel engine and a pipe to each.

    Owns processes, not device memory (each worker's runner owns and
    releases its own). ``started`` becomes True once every worker has loaded
    its weights and the ranks agreed on the KV cache size.
    """

    def __init__(self, world: int, address: tuple[str, int], configs: list[EngineConfig],
                 eos_token_ids: frozenset[int], timeout_s: float) -> None:
        ctx = mp.get_context("spawn")
        self.workers: list[_Worker] = []
        self.started = False
        self._watcher: threading.Thread | None = None
        self._wake: Connection | None = None
        try:
            for rank, config in zip(range(1, world), configs):
                parent, child = ctx.Pipe()
                spec = WorkerSpec(rank, world, address, config, eos_token_ids, timeout_s, os.getpid())
                process = ctx.Process(target=run_worker, args=(spec, child), name=f"tidyrun-tp-rank{rank}",
                                      daemon=True)
                process.start()
                child.close()  # the worker's end lives in the worker only: its exit closes the pipe
                self.workers.append(_Worker(rank, process, parent))
        except BaseException:
            self.kill()
            raise

    # -- failures --------------------------------------------------------------------

    def _reported_error(self, w: _Worker) -> str:
        """The error message a worker sent before it stopped, if any is waiting in its pipe."""
        try:
            while w.conn.poll():
                msg = w.conn.recv()
                if msg[0] == "error":
                    return f": {msg[1]}: {msg[2]}"
        except (EOFError, OSError):
            pass
        return ""

    def _died(self, w: _Worker) -> WorkerDiedError:
        w.process.join(1.0)
        hint = "" if self.started else (
            " during start-up (its traceback is above; a script that builds a tensor-parallel LLM needs "
            "`if __name__ == \"__main__\":`, since workers are spawned and import the main module)")
        return WorkerDiedError(f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) "
                               f"{_exit_description(w.process.exitcode)}{self._reported_error(w)}{hint}")

    def check(self) -> None:
        """Raise WorkerDiedError if a worker process has exited."""
        for w in self.workers:
            if w.process.exitcode is not None:
                raise self._died(w)

    def failure(self, grace_s: float = 5.0) -> WorkerError | None:
        """After a failed collective: the worker that caused it (died, or reported an error), if any
        does within ``grace_s``; None if every worker is alive and silent (the driver failed itself)."""
        pending = {w.process.sentinel: w for w in self.workers} | {w.conn: w for w in self.workers}
        for ready in wait(list(pending), grace_s):
            w = pending[ready]
            if ready is not w.conn:
                return self._died(w)
            error = self._reported_error(w)
            if error:
                return WorkerError(f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) failed{error}")
        return None

    # -- messages --------------------------------------------------------------------

    def send(self, msg: tuple) -> None:
        """Send ``msg`` to every worker; a dead worker raises WorkerDiedError."""
        self.check()
        for w in self.workers:
            try:
                w.conn.send(msg)
            except OSError:  # BrokenPipeError: it exited after the check
                raise self._died(w) from None

    def _recv(self, w: _Worker, timeout_s: float) -> tuple:
        ready = wait([w.conn, w.process.sentinel], timeout_s)
        if w.conn in ready:
            try:
                return w.conn.recv()
            except (EOFError, OSError):
                raise self._died(w) from None
        if ready:
            raise self._died(w)
        raise WorkerError(f"tensor-parallel worker rank {w.rank} (pid {w.process.pid}) did not answer "
                          f"within {timeout_s:.0f} s")

    def replies(self, timeout_s: float = REPLY_TIMEOUT_S) -> list[tuple]:
        """One reply from each worker, by rank: ("ok", value) or ("error", type name, message)."""
        return [self._recv(w, timeout_s) for w in self.workers]

    def agree_num_blocks(self, local: int) -> int:
        """Wait until every worker has loaded its slice and proposed a KV block count; all ranks use the least.

        A worker that failed to start raises here, as the error it reported
        (same tidyrun error class where there is one) prefixed with its rank.
        """
        counts = [local]
        for w, msg in zip(self.workers, self.replies(START_TIMEOUT_S)):
            if msg[0] == "error":
                raise _startup_error(w.rank, msg[1], msg[2])
            counts.append(msg[1])
        agreed = min(counts)
        self.send(("blocks", agreed))
        self.started = True
        return agreed

    def watch(self, on_death: Callable[[], None]) -> None:
        """From now on, call ``on_death()`` from a background thread as soon as a worker exits unexpectedly.

        The driver passes its group's ``abort``: a collective waiting on a
        dead peer then fails at once instead of at its timeout. Exits the
        pool causes itself (``request_shutdown``, ``kill``) stop the watch first.
        """
        wake_r, self._wake = mp.get_context("spawn").Pipe(duplex=False)
        sentinels = [w.process.sentinel for w in self.workers]

        def run() -> None:
            if wake_r not in wait([*sentinels, wake_r]):
                logger.error("a tensor-parallel worker exited; aborting the group's collectives")
                try:
                    on_death()
                except Exception:  # the step that fails next reports the death; this thread must just end
                    logger.exception("aborting the tensor-parallel group failed")
            wake_r.close()

        self._watcher = threading.Thread(target=run, name="tidyrun-tp-watch", daemon=True)
        self._watcher.start()

    def _unwatch(self) -> None:
        if self._watcher is None:
            return
        try:
            self._wake.send(None)
        except OSError:  # the watcher already saw a death, ended and closed its end
            pass
        self._watcher.join()
        self._wake.close()
        self._watcher = self._wake = None

    # -- teardown --------------------------------------------------------------------

    def request_shutdown(self) -> None:
        """Ask every worker to shut down (each replies with its report, collected by ``close``)."""
        self._unwatch()
        self.send(("shutdown",))

    def close(self) -> list:
        """After ``send(("shutdown",))``: collect each worker's reply (its shutdown report, or None for a
        worker that died or did not answer) and join every process; stragglers are terminated, then killed."""
        reports = []
        for w in self.workers:
            report = None
            if self.started:  # a worker that already exited may have left its report in the pipe
                try:
                    msg = self._recv(w, EXIT_TIMEOUT_S)
                    report = msg[1] if msg[0] == "ok" else None
                except WorkerError:
                    pass
            reports.append(report)
        self.kill(EXIT_TIMEOUT_S if self.started else 0.0)  # before start-up completed, nobody waits to exit
        return reports

    def kill(self, join_s: float = 0.0) -> None:
        """Join every worker (waiting up to ``join_s`` for a clean exit), terminating, then killing, stragglers."""
        self._unwatch()
        for w in self.workers:
            w.process.join(join_s)
        for w in self.workers:
            if w.process.exitcode is None:
                w.process.terminate()
        for w in self.workers:
            w.process.join(EXIT_TIMEOUT_S)
            if w.process.exitcode is None:
                w.process.kill()
                w.process.join()
            w.conn.close()
            w.process.close()
        self.workers = []


def _startup_error(rank: int, type_name: str, message: str) -> Exception:
    from .. import errors

    cls = getattr(errors, type_name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.TidyrunError)):
        cls = WorkerError
    return cls(f"tensor-parallel worker rank {rank} failed to start: {type_name}: {message}")
