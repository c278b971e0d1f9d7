"""What a request's ``SamplingParams.output_kind`` shows of its progress, for the engines that hand out
outputs while requests run (``LLMEngine.step``, ``AsyncLLM.generate``).

``CUMULATIVE`` (vLLM's default): everything so far; ``DELTA``: only what is new since the request's last
output (prompt logprobs once, with the first); ``FINAL_ONLY``: the finished output alone. In every kind,
text that could still be the start of a stop string is held back until it is decided, as vLLM does. With
``n > 1`` the streaming kinds carry, as vLLM's do, only the completions that advanced: one that finished is
shown finished once, never again.
"""

from __future__ import annotations

import copy
import dataclasses

from ...errors import InvalidRequestError
from ...outputs import RequestOutput
from ...sampling_params import RequestOutputKind, SamplingParams
from ...sequence import streamable_length


def check_request(who: str, request_id, params, lora_request, priority, tokenization_kwargs) -> None:
    """The refusals both engines give a new request (``who``: the method, for the message), before any of
    it is queued: vLLM's arguments that have no counterpart here are accepted only at their neutral value."""
    if not isinstance(request_id, str):
        raise InvalidRequestError(f"request_id must be a str, got {type(request_id).__name__}")
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"{who} takes SamplingParams, got {type(params).__name__} (pooling runs through "
                                  "LLM.embed / encode)")
    if lora_request is not None:
        raise InvalidRequestError("lora_request is not supported: tidyrun has no LoRA adapters; pass None")
    if priority != 0:
        raise InvalidRequestError(f"priority={priority!r} is not supported: requests are scheduled first come, "
                                  "first served (vLLM's default policy); pass 0")
    if tokenization_kwargs:
        raise InvalidRequestError(f"tokenization_kwargs={tokenization_kwargs!r} is not supported; tokenize the "
                                  "prompt yourself and pass {'prompt_token_ids': [...]}")


def checked(params: SamplingParams) -> SamplingParams:
    """A checked copy of a caller's (mutable, as vLLM's) params: what its view reads, after the caller's
    last changes; InvalidRequestError for bad ones, before the request is queued."""
    if not isinstance(params, SamplingParams):
        raise InvalidRequestError(f"expected SamplingParams, got {type(params).__name__}")
    params = copy.copy(params)
    params.validate()
    return params


class OutputView:
    """One request's outputs as its output kind shows them; remembers what it has shown."""

    def __init__(self, params: SamplingParams, request_id: str | None = None) -> None:
        """``params``: the request's, checked (``validate``: ``stop`` a list, ``output_kind`` the enum);
        ``request_id``: the id to show (an engine that runs the request under another id of its own)."""
        self.kind = RequestOutputKind(params.output_kind)
        self._stop = tuple(params.stop or ())
        self._finished: set[int] = set()  # completions already shown finished
        self._request_id = request_id
        self._tokens: dict[int, int] = {}
        self._chars: dict[int, int] = {}
        self._prompt_shown = False

    @property
    def final_only(self) -> bool:
        return self.kind == RequestOutputKind.FINAL_ONLY

    def show(self, out: RequestOutput) -> RequestOutput | None:
        """``out`` as this request's kind shows it now; None when nothing new is ready to show."""
        if self.final_only and not out.finished:
            return None
        delta = self.kind == RequestOutputKind.DELTA
        completions = []
        for c in out.outputs:
            if c.index in self._finished:
                continue
            visible = streamable_length(c.text, self._stop, c.finished())
            tokens, chars = self._tokens.get(c.index, 0), self._chars.get(c.index, 0)
            if not (self.final_only or c.finished() or len(c.token_ids) > tokens or visible > chars):
                continue  # nothing new in this completion
            if c.finished() and not self.final_only:
                self._finished.add(c.index)
            if delta:
                completions.append(dataclasses.replace(
                    c, text=c.text[chars:visible], token_ids=c.token_ids[tokens:],
                    logprobs=None if c.logprobs is None else c.logprobs[tokens:]))
            else:
                completions.append(c if visible == len(c.text) else dataclasses.replace(c, text=c.text[:visible]))
            self._tokens[c.index], self._chars[c.index] = len(c.token_ids), max(chars, visible)
        if not completions and not out.finished:
            return None
        if not out.finished and all(c.finished() for c in completions):
            # RequestOutput.finished reads its completions: keep a running one in, unchanged (an empty delta)
            running = next(c for c in out.outputs if not c.finished())
            shown = self._chars.get(running.index, 0)
            completions.append(dataclasses.replace(running, text="", token_ids=[], logprobs=None if running.logprobs
                                                   is None else []) if delta
                               else dataclasses.replace(running, text=running.text[:shown]))
        changes = {"outputs": completions}
        if delta and self._prompt_shown:
            changes["prompt_logprobs"] = None  # a delta stream carries them once, with its first output
        if self._request_id is not None:
            changes["request_id"] = self._request_id
        self._prompt_shown = True
        return dataclasses.replace(out, **changes)
