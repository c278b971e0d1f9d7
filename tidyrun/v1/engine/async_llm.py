"""vLLM's ``AsyncLLM`` (also exported as ``AsyncLLMEngine``): ``async for output in engine.generate(...)``.

Async rollout workers, agent loops and custom servers drive vLLM this way: many coroutines each call
``generate(prompt, params, request_id)`` and the engine batches them. Here one ``EngineLoop`` thread
(the server's: it owns the ``LLM``, drains new requests and aborts, steps, and pushes each request's
progress to the coroutine waiting for it) does that, so the asyncio loop never runs a step. Outputs follow
the request's ``output_kind`` (``output_kind.py``). A coroutine that stops iterating (``break``, a
cancelled task) aborts its request, freeing its KV blocks.

It owns the ``LLM`` it makes or is given; ``shutdown()`` stops the loop thread, which shuts the engine
down after its last step with the verified teardown. It holds no device memory of its own.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Iterable

from ...arg_utils import llm_from_engine_args
from ...engine import LLM
from ...errors import EngineShutdownError, InvalidRequestError
from ...outputs import RequestOutput
from ...sampling_params import SamplingParams
from ...engine_loop import EngineLoop, Submission
from .output_kind import OutputView, check_request, checked


class AsyncLLM:
    """The asyncio engine API over an ``LLM`` (see the module docstring)."""

    def __init__(self, llm: LLM) -> None:
        if not isinstance(llm, LLM):
            raise InvalidRequestError(f"AsyncLLM wraps a tidyrun.LLM, got {type(llm).__name__}; build one with "
                                      "AsyncLLM.from_engine_args(AsyncEngineArgs(...))")
        self._loop = EngineLoop(llm)
        self._loop.start()
        self._running: dict[str, Submission] = {}

    @classmethod
    def from_engine_args(cls, engine_args, start_engine_loop: bool = True, usage_context=None, stat_loggers=None,
                         **_process_options) -> AsyncLLM:
        """An engine built from ``(Async)EngineArgs`` (every field an ``LLM`` keyword), its loop started.
        ``usage_context`` and vLLM's process options have nothing to choose here; custom ``stat_loggers``
        and a loop left unstarted are refused."""
        if not start_engine_loop:
            raise InvalidRequestError("start_engine_loop=False is not supported: the engine thread starts with the "
                                      "engine")
        return cls(llm_from_engine_args(engine_args, stat_loggers, "AsyncLLM"))

    # -- requests ----------------------------------------------------------------------

    async def generate(self, prompt, sampling_params: SamplingParams, request_id: str, *, prompt_text=None,
                       lora_request=None, tokenization_kwargs: dict | None = None, trace_headers=None,
                       priority: int = 0, data_parallel_rank: int | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """The request's outputs as the engine advances it, the last one finished. A bad request raises
        here, before anything is yielded; a LoRA adapter, a priority other than 0, tokenizer keywords and a
        data-parallel rank other than 0 are refused (``prompt_text`` and ``trace_headers`` have no effect)."""
        check_request("AsyncLLM.generate", request_id, sampling_params, lora_request, priority, tokenization_kwargs)
        if data_parallel_rank not in (None, 0):
            raise InvalidRequestError(f"data_parallel_rank={data_parallel_rank!r}: this engine is one rank; pass None")
        if request_id in self._running:
            raise InvalidRequestError(f"request id {request_id!r} is already running")
        view = OutputView(checked(sampling_params), request_id)
        sub = self._loop.submit(prompt, sampling_params, stream=not view.final_only)
        self._running[request_id] = sub
        try:
            await sub.accepted()
            async for out in sub:
                shown = view.show(out)
                if shown is not None:
                    yield shown
        finally:
            sub.close()  # a consumer that stopped early (or was cancelled) aborts its request
            if self._running.get(request_id) is sub:
                del self._running[request_id]

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Abort these requests (one id or several; unknown ids are no error); each generator then ends with
        a finished output whose finish_reason is "abort"."""
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            sub = self._running.get(rid)
            if sub is not None:
                self._loop.abort(sub)

    # -- the engine (each call runs on the engine thread, between steps) -------------------

    async def get_tokenizer(self):
        return self._loop.llm.get_tokenizer()

    async def get_model_config(self):
        return await self._loop.call(lambda e: e.llm_engine.model_config)

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return await self._loop.call(lambda e: e.reset_prefix_cache(reset_running_requests, reset_connector))

    async def sleep(self, level: int = 1) -> None:
        await self._loop.call(lambda e: e.sleep(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        await self._loop.call(lambda e: e.wake_up(tags))

    async def is_sleeping(self) -> bool:
        return await self._loop.call(lambda e: e.is_sleeping)

    async def collective_rpc(self, method, timeout: float | None = None, args: tuple = (),
                             kwargs: dict | None = None):
        return await self._loop.call(lambda e: e.collective_rpc(method, timeout, args, kwargs))

    async def get_metrics(self):
        return await self._loop.call(lambda e: e.get_metrics())

    async def check_health(self) -> None:
        """vLLM's health check: raises EngineShutdownError saying why the engine does not serve."""
        reason = self._loop.unhealthy
        if reason is not None:
            raise EngineShutdownError(reason)

    @property
    def is_running(self) -> bool:
        return self._loop.running

    @property
    def errored(self) -> bool:
        return self._loop.died is not None

    @property
    def dead_error(self) -> BaseException:
        return EngineShutdownError(self._loop.unhealthy or "the engine is running")

    def shutdown(self):
        """Abort what runs, stop the engine thread and shut the engine down on it; returns its report
        (idempotent)."""
        if self._loop.running or self._loop.shutdown_report is None:
            return self._loop.stop()
        return self._loop.shutdown_report


AsyncLLMEngine = AsyncLLM  # vLLM's older name, the same object since its V1 engine
