"""vLLM's ``LLMEngine``: requests added by id and stepped by hand, each step returning what it advanced.

vLLM's own examples (``llm_engine_example.py``, ``reset_kv.py``) and many serving loops drive the engine
this way: ``LLMEngine.from_engine_args(EngineArgs(...))``, ``add_request(request_id, prompt, params)``,
``step()`` until ``has_unfinished_requests()`` is False. ``LLM`` offers the same loop, but its ``step()``
returns finished requests only; here, as in vLLM, ``step()`` returns an output for every request the step
advanced, as its ``SamplingParams.output_kind`` asks (``output_kind.py``).

It owns the ``LLM`` it makes (``from_engine_args``) or is given, and ``shutdown()`` (or leaving a ``with``
block) shuts that down with its verified teardown; it holds no device memory of its own.
"""

from __future__ import annotations

from collections.abc import Iterable

from ...arg_utils import llm_from_engine_args
from ...engine import LLM
from ...errors import InvalidRequestError
from ...outputs import RequestOutput
from ...sampling_params import SamplingParams
from .output_kind import OutputView, check_request, checked


class LLMEngine:
    """The step-by-step engine API over an ``LLM`` (see the module docstring)."""

    def __init__(self, llm: LLM) -> None:
        if not isinstance(llm, LLM):
            raise InvalidRequestError(f"LLMEngine wraps a tidyrun.LLM, got {type(llm).__name__}; build one with "
                                      "LLMEngine.from_engine_args(EngineArgs(...))")
        self.llm = llm
        self._tracked: dict[str, OutputView] = {}  # in add order: outputs come back in that order

    @classmethod
    def from_engine_args(cls, engine_args, usage_context=None, stat_loggers=None,
                         enable_multiprocessing: bool = False) -> LLMEngine:
        """An engine built from ``EngineArgs`` (every field an ``LLM`` keyword). ``usage_context`` and
        ``enable_multiprocessing`` are vLLM's process plumbing, with nothing to choose here; custom
        ``stat_loggers`` are refused (``LLM.get_metrics()`` reads the engine's counters)."""
        return cls(llm_from_engine_args(engine_args, stat_loggers, "LLMEngine"))

    # -- requests ----------------------------------------------------------------------

    def add_request(self, request_id: str, prompt, params: SamplingParams, arrival_time: float | None = None,
                    lora_request=None, tokenization_kwargs: dict | None = None, trace_headers=None,
                    priority: int = 0, prompt_text: str | None = None) -> str:
        """Queue ``prompt`` under ``request_id`` (vLLM's argument order). ``arrival_time`` and
        ``trace_headers`` are bookkeeping with no effect here; a LoRA adapter, a priority other than 0 and
        tokenizer keywords are refused with the reason."""
        check_request("LLMEngine.add_request", request_id, params, lora_request, priority, tokenization_kwargs)
        if request_id in self._tracked:
            raise InvalidRequestError(f"request id {request_id!r} is already in flight")
        view = OutputView(checked(params))
        self.llm.add_request(prompt, params, request_id=request_id)
        self._tracked[request_id] = view
        return request_id

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop these requests (one id or several); their last outputs come with the next ``step()``."""
        for request_id in [request_ids] if isinstance(request_ids, str) else list(request_ids):
            if request_id in self._tracked:
                self.llm.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        """Run one step; an output for each request it advanced (by its output kind), finished ones last
        of their own."""
        finished = {out.request_id: out for out in self.llm.step()}
        outputs = []
        for request_id, view in list(self._tracked.items()):
            out = finished.get(request_id)
            if out is None:
                if view.final_only:
                    continue
                out = self.llm.request_output(request_id)
                if out is None:  # added straight to the LLM under this id and collected there
                    del self._tracked[request_id]
                    continue
            else:
                del self._tracked[request_id]
            shown = view.show(out)
            if shown is not None:
                outputs.append(shown)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._tracked) or self.llm.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return len(self._tracked)

    # -- the engine --------------------------------------------------------------------

    def get_tokenizer(self):
        return self.llm.get_tokenizer()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        return self.llm.reset_prefix_cache(reset_running_requests, reset_connector)

    def sleep(self, level: int = 1) -> None:
        self.llm.sleep(level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.llm.is_sleeping

    def collective_rpc(self, method, timeout: float | None = None, args: tuple = (), kwargs: dict | None = None):
        return self.llm.collective_rpc(method, timeout, args, kwargs)

    def get_metrics(self):
        return self.llm.get_metrics()

    @property
    def model_config(self):
        return self.llm.llm_engine.model_config

    def shutdown(self):
        """Shut the LLM down (its report says what was given back); idempotent."""
        return self.llm.shutdown()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
