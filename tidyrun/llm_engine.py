"""``llm.llm_engine...model.load_weights(...)``: the path TRL and verl take to push weights into vLLM's model.

TRL's GRPO colocate mode syncs the trainer's weights with
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])``,
verl with ``...driver_worker.worker.model_runner.model.load_weights(weights)``.
Those are vLLM's internals. tidyrun's own (the runner, the model) are not
handed out: whoever kept one would keep device memory alive past
``shutdown()``. Instead ``llm.llm_engine`` is this one small read-only
object, standing for every step of that path, whose only method is
``load_weights`` = ``LLM.load_weights``. It refers to the engine weakly,
so keeping it keeps nothing alive.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch

from .errors import EngineShutdownError


class WeightSyncPath:
    """``llm_engine``, ``model_executor``, ``driver_worker``, ``worker``, ``model_runner`` and ``model`` at once."""

    __slots__ = ("_llm",)

    def __init__(self, llm) -> None:
        self._llm = weakref.ref(llm)

    @property
    def model_executor(self) -> WeightSyncPath:
        return self

    driver_worker = worker = model_runner = model = model_executor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """``LLM.load_weights(weights)``; returns the names given, as vLLM's ``model.load_weights`` returns the
        names it loaded (verl logs how many)."""
        llm = self._llm()
        if llm is None:
            raise EngineShutdownError("the LLM this llm_engine belonged to is gone; create a new one")
        names: set[str] = set()

        def recorded():  # tensors pass one at a time, as the caller's iterable yields them
            for item in weights:
                if isinstance(item, tuple) and item and isinstance(item[0], str):
                    names.add(item[0])
                yield item

        llm.load_weights(recorded())
        return names
