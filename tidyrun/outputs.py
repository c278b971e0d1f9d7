"""What generate() returns, shaped like vLLM's RequestOutput/CompletionOutput (same fields, same order)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs; None unless logprobs asked
    logprobs: SampleLogprobs | None = None  # one {token id: Logprob} per generated token, if asked
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        """A method, as in vLLM (``RequestOutput.finished`` is not)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def finished(self) -> bool:
        return all(o.finished() for o in self.outputs)
