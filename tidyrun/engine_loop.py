"""EngineLoop: one thread owns the LLM; its asyncio readers (HTTP handlers, AsyncLLM) talk to it through
a command queue.

The LLM is not thread-safe, and batching needs one place that sees every
request: the loop thread drains all pending commands (new requests, aborts,
lifecycle calls), runs one engine step for everything in flight, and pushes
each request's output so far to the asyncio queue of the handler waiting for
it. Idle, it blocks on the command queue and costs nothing.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .engine import LLM
from .errors import EngineShutdownError
from .intake import PromptType
from .outputs import RequestOutput
from .sampling_params import SamplingParams

logger = logging.getLogger("tidyrun.server")


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    stream: bool = True  # False: only the final output is wanted (the text is then built once, at the end)

    def push(self, item) -> bool:
        """Hand ``item`` to the waiting coroutine; False when its event loop is closed (an ``asyncio.run``
        that returned while its request ran): nobody is left to read it, and the engine thread goes on."""
        return _deliver(self.loop, self.queue.put_nowait, item)


@dataclass
class _Failure:
    error: BaseException


@dataclass
class EngineStats:
    """Figures the metrics endpoint reads; replaced whole by the loop thread after every step (the device
    memory figures only after lifecycle calls: reading them walks the ledger)."""

    values: dict = field(default_factory=dict)


_HUNG_STEP_S = 300.0  # after stop()'s timeout, how much longer a step may run before the loop is abandoned
_ACCEPTED = object()  # the first item a subscriber gets once the engine has queued its request


class Submission:
    """One request handed to the engine loop.

    ``await accepted()`` returns once the engine has queued it, or raises what
    the engine refused it for (a bad parameter, a sleeping engine): a handler
    awaits it before it starts a 200 stream, so every refusal is a clean
    error response, never a stream cut short. Iterating yields the request's
    outputs until it finishes. ``close()`` aborts it if it has not finished
    (freeing its KV blocks); handlers call it in ``finally`` whatever happened.
    """

    def __init__(self, commands: queue.SimpleQueue, request_id: str, sub: _Subscriber) -> None:
        self._commands, self.request_id, self._sub = commands, request_id, sub
        self._accepted = False
        self._over = False  # finished, refused or closed: nothing left to abort

    async def accepted(self) -> None:
        if self._accepted:
            return
        item = await self._sub.queue.get()
        if isinstance(item, _Failure):
            self._over = True
            raise item.error
        self._accepted = True

    def __aiter__(self) -> Submission:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._over:
            raise StopAsyncIteration
        await self.accepted()
        item = await self._sub.queue.get()
        if isinstance(item, _Failure):
            self._over = True
            raise item.error
        if item.finished:
            self._over = True
        return item

    def close(self) -> None:
        if not self._over:
            self._over = True
            self._commands.put(("abort", self.request_id))


class EngineLoop:
    """Runs ``llm`` on a background thread until ``stop()``."""

    def __init__(self, llm: LLM, on_death: Callable[[str], None] | None = None) -> None:
        """``on_death(reason)`` runs on the loop thread if it dies (after the engine was shut down): the
        server uses it to stop, so the process exits non-zero instead of serving 503s forever."""
        self.llm = llm
        self._on_death = on_death
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tidyrun-engine", daemon=True)
        self.stats = EngineStats(llm.stats())
        self.shutdown_report = None
        self._died: str | None = None  # what killed the loop thread, if something did

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self._stopping.is_set()

    @property
    def unhealthy(self) -> str | None:
        """None while the loop serves requests; else why it does not (for /health's 503)."""
        if self._died is not None:
            return f"the engine thread died: {self._died}"
        if self._stopping.is_set():
            return "the engine is shutting down or shut down"
        if not self._thread.is_alive():
            return "the engine thread is not running"
        return None

    # -- called from the event loop -----------------------------------------------------

    def _check_running(self) -> None:
        if not self.running:
            raise EngineShutdownError("the server is shutting down")

    def submit(self, prompt: PromptType, params: SamplingParams, stream: bool = True) -> Submission:
        """Queue one request; ``await accepted()`` on the result, then iterate its outputs
        (``stream=False``: only the final one)."""
        self._check_running()
        request_id = uuid.uuid4().hex
        sub = _Subscriber(asyncio.get_running_loop(), asyncio.Queue(), stream)
        self._commands.put(("add", request_id, prompt, params, sub))
        return Submission(self._commands, request_id, sub)

    async def call(self, fn: Callable[[LLM], object]):
        """Run ``fn(llm)`` on the loop thread between steps and return its result (or raise its error)."""
        self._check_running()
        future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", fn, future, asyncio.get_running_loop()))
        return await future

    def abort(self, sub: Submission) -> None:
        """Abort one request in flight and still hand its subscriber the final output (finish_reason
        "abort"), as ``abort_all`` does for every one (``Submission.close`` aborts without an answer)."""
        self._commands.put(("abort_one", sub.request_id))

    def abort_all(self) -> None:
        """Abort every request in flight; each still gets its final output (finish_reason "abort"), so its
        client sees a proper end: the graceful stop's last step, when the grace period is over. Safe from
        any thread."""
        self._commands.put(("abort_all",))

    def stop(self, timeout: float = 30.0):
        """Abort what is in flight, shut the engine down on its thread, and join it; returns the report.

        Ordered: the engine is shut down by the thread that steps it, after its
        last step, and this returns only once that thread has ended (a step
        still running after ``timeout`` is waited for, with a warning: shutting
        down beside a running step would free what it reads). A step hung for
        ``_HUNG_STEP_S`` more is abandoned: None is returned, nothing is shut
        down, and the process may exit. A loop that never started shuts the
        engine down here.
        """
        self._stopping.set()
        if self._thread.ident is None:  # never started (e.g. the server could not bind its port)
            self._shutdown()
            return self.shutdown_report
        self._commands.put(("stop",))
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("the engine is still in a step %.0f s after stop(); waiting for it to end", timeout)
            self._thread.join(_HUNG_STEP_S)
        if self._thread.is_alive():  # a hung step (a collective that never returns): never free under it
            logger.error("the engine step did not end in %.0f s more; leaving without shutting the engine down "
                         "(its memory goes with the process)", _HUNG_STEP_S)
            return None
        return self.shutdown_report

    # -- the loop thread ---------------------------------------------------------------

    def _run(self) -> None:
        llm = self.llm
        try:
            while True:
                block = not llm.has_unfinished_requests()
                try:
                    commands = [self._commands.get(block=block, timeout=None)] if block else []
                except queue.Empty:
                    commands = []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                for cmd in commands:
                    if cmd[0] == "stop":
                        return
                    self._execute(cmd)
                if llm.has_unfinished_requests():
                    self._step()
                # The memory figures are kept from the last lifecycle call (reading them walks the ledger).
                memory = {"device_memory_bytes": self.stats.values["device_memory_bytes"]}
                self.stats = EngineStats(llm.stats(memory=False) | memory)
        except BaseException as exc:  # the loop itself failed (a step's own errors are handled in _step)
            self._died = f"{type(exc).__name__}: {exc}"
            logger.exception("the engine loop died")
        finally:
            self._shutdown()
        if self._died is not None and self._on_death is not None:
            self._on_death(self._died)

    @property
    def died(self) -> str | None:
        """What killed the loop thread (None: nothing did)."""
        return self._died

    def _execute(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, request_id, prompt, params, sub = cmd
            try:
                self.llm.add_request(prompt, params, request_id=request_id)
                self._subscribers[request_id] = sub
                if not sub.push(_ACCEPTED):  # its reader's event loop closed before the request was queued
                    del self._subscribers[request_id]
                    self.llm.abort_request(request_id)
            except Exception as exc:  # a bad request fails alone; the loop keeps serving
                sub.push(_Failure(exc))
        elif kind == "abort":
            request_id = cmd[1]
            if self._subscribers.pop(request_id, None) is not None:
                self.llm.abort_request(request_id)
        elif kind == "abort_one":  # its subscriber stays: the next step hands it the aborted output
            if cmd[1] in self._subscribers:
                self.llm.abort_request(cmd[1])
        elif kind == "abort_all":  # the subscribers stay: the next step hands them their aborted outputs
            for request_id in self._subscribers:
                self.llm.abort_request(request_id)
        elif kind == "call":
            _, fn, future, loop = cmd
            try:
                result = fn(self.llm)
                self._refresh_memory()  # sleep, wake_up, update_weights...: before the caller sees the result
            except Exception as exc:
                _deliver(loop, _set_exception, future, exc)
            else:
                _deliver(loop, _set_result, future, result)

    def _refuse_queued(self) -> None:
        while True:
            try:
                _refuse(self._commands.get_nowait())
            except queue.Empty:
                return

    def _refresh_memory(self) -> None:
        if not self.llm.is_shut_down:
            memory = self.llm.stats()["device_memory_bytes"]
            self.stats = EngineStats(self.stats.values | {"device_memory_bytes": memory})

    def _step(self) -> None:
        try:
            finished = {o.request_id: o for o in self.llm.step()}
        except Exception as exc:  # an engine bug: fail the requests in flight, keep the server up
            logger.exception("engine step failed; aborting %d request(s)", len(self._subscribers))
            for request_id, sub in list(self._subscribers.items()):
                self.llm.abort_request(request_id)
                sub.push(_Failure(exc))
            self._subscribers.clear()
            self.llm.step()  # collect the aborted outputs
            return
        for request_id, sub in list(self._subscribers.items()):
            if not sub.stream and request_id not in finished:
                continue  # building an intermediate output would detokenize every step for nobody
            out = finished.get(request_id) or self.llm.request_output(request_id)
            delivered = out is None or sub.push(out)
            if request_id in finished or not delivered:
                del self._subscribers[request_id]
                if request_id not in finished:  # its reader's event loop is gone: free its blocks
                    self.llm.abort_request(request_id)

    def _shutdown(self) -> None:
        self._refuse_queued()
        try:
            report = self.llm.shutdown()
            self.shutdown_report = report
            for out in report.aborted:
                sub = self._subscribers.pop(out.request_id, None)
                if sub is not None:
                    sub.push(out)
            logger.info("engine shut down: %s", report)
        except Exception:
            logger.exception("engine shutdown failed")


def _refuse(cmd: tuple) -> None:
    """Answer a command the loop will never run (queued after its stop) so that nobody waits on it."""
    error = EngineShutdownError("the engine was shut down before this was run")
    if cmd[0] == "add":
        cmd[4].push(_Failure(error))
    elif cmd[0] == "call":
        _deliver(cmd[3], _set_exception, cmd[2], error)


def _deliver(loop: asyncio.AbstractEventLoop, fn, *args) -> bool:
    """``fn(*args)`` on ``loop``'s thread; False (and nothing done) when that loop is closed."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # "Event loop is closed": checked by the call itself, so no race with is_closed()
        return False
    return True


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
