"""The ``choices`` of completions and chat responses, whole or as stream deltas, from engine outputs.

One object per HTTP request holds what its choices need (the prompt, how
many top logprobs, echo) and, when streaming, how much of each choice has
been sent: a delta carries the text that became visible since the last one
(text that could still turn out to be the start of a stop string is held
back) and the logprobs of every token generated since, so the deltas of a
choice add up to the whole choice.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..outputs import CompletionOutput, RequestOutput
from ..sequence import streamable_length
from .logprobs_format import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs_json


@dataclass
class _Sent:
    """How much of one choice a stream has sent."""

    chars: int = 0  # characters of the generated text
    tokens: int = 0  # generated tokens (their logprobs)
    offset: int = 0  # text_offset of the next token (token texts so far, echoed prompt included)
    started: bool = False


class _Choices:
    def __init__(self, texts: TokenText, stop: Sequence[str], top_logprobs: int | None,
                 prompt_logprobs: int | None, token_ids: bool = False) -> None:
        self.texts = texts
        self.stop = tuple(stop)
        self.k = top_logprobs  # None: no logprobs asked
        self.prompt_k = prompt_logprobs
        self.token_ids = token_ids  # vLLM's return_token_ids: each choice's (delta's) generated token ids
        self._sent: dict[int, _Sent] = {}

    def generated(self, c: CompletionOutput) -> tuple[str, list[int], list | None]:
        """The text, token ids and logprobs of what a choice generated."""
        return c.text, c.token_ids, c.logprobs

    def prompt_logprobs(self, out: RequestOutput) -> list | None:
        """vLLM's ``prompt_logprobs`` extra, when asked."""
        return prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs, self.prompt_k, self.texts)

    def _advance(self, c: CompletionOutput) -> tuple[_Sent, str, list[int], list | None] | None:
        """What a choice has to send now (state, new text, new token ids, their logprobs), or None."""
        sent = self._sent.setdefault(c.index, _Sent())
        text, ids, steps = self.generated(c)
        visible = streamable_length(text, self.stop, c.finished())
        if visible <= sent.chars and not c.finished() and (sent.started or not self._opens(c)):
            return None
        piece = text[sent.chars:visible]
        new_steps = None if steps is None else steps[sent.tokens:]
        new_ids = ids[sent.tokens:]
        sent.chars, sent.tokens = max(sent.chars, visible), len(ids)
        return sent, piece, new_ids, new_steps

    def _opens(self, c: CompletionOutput) -> bool:
        """Whether a choice's first delta is due before it has text (echo: the prompt is)."""
        return False


class CompletionChoices(_Choices):
    """Choices of /v1/completions. With ``echo`` the prompt's text (and, with logprobs, its tokens'
    logprobs, the first being null) comes first; ``score_only`` (echo with max_tokens=0) drops what
    was generated, leaving the prompt alone."""

    def __init__(self, texts: TokenText, stop: Sequence[str], logprobs: int | None, prompt_logprobs: int | None,
                 echo: bool, prompt_text: str, score_only: bool = False, token_ids: bool = False) -> None:
        super().__init__(texts, stop, logprobs, prompt_logprobs, token_ids)
        self.echo, self.prompt_text, self.score_only = echo, prompt_text, score_only

    def generated(self, c: CompletionOutput) -> tuple[str, list[int], list | None]:
        return ("", [], []) if self.score_only else (c.text, c.token_ids, c.logprobs)

    def _opens(self, c: CompletionOutput) -> bool:
        return self.echo

    def _logprobs(self, out: RequestOutput, ids: list[int], steps: list | None, echo: bool, offset: int):
        if self.k is None or steps is None or (echo and out.prompt_logprobs is None):
            return None  # not asked, or the engine did not return them
        if echo:
            ids, steps = list(out.prompt_token_ids) + list(ids), list(out.prompt_logprobs) + list(steps)
        return completion_logprobs(ids, steps, self.k, self.texts, offset)

    def whole(self, out: RequestOutput, c: CompletionOutput, index: int) -> dict:
        text, ids, steps = self.generated(c)
        choice = {"index": index, "text": (self.prompt_text if self.echo else "") + text,
                  "logprobs": self._logprobs(out, ids, steps, self.echo, 0),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.prompt_k is not None:
            choice["prompt_logprobs"] = self.prompt_logprobs(out)
        if self.token_ids:  # vLLM puts the prompt's ids in each completion choice
            choice["prompt_token_ids"], choice["token_ids"] = list(out.prompt_token_ids), list(ids)
        return choice

    def delta(self, out: RequestOutput, c: CompletionOutput) -> dict | None:
        step = self._advance(c)
        if step is None:
            return None
        sent, piece, ids, steps = step
        echo = self.echo and not sent.started
        if echo:
            piece = self.prompt_text + piece
        logprobs = self._logprobs(out, ids, steps, echo, sent.offset)
        if logprobs is not None and logprobs["tokens"]:  # offsets count token texts, as in the whole choice
            sent.offset = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        delta = {"index": c.index, "text": piece, "logprobs": logprobs, "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason}
        if self.token_ids:  # the prompt's ids with a choice's first delta only, as vLLM streams them
            delta["prompt_token_ids"] = None if sent.started else list(out.prompt_token_ids)
            delta["token_ids"] = list(ids)
        sent.started = True
        return delta


class ChatChoices(_Choices):
    """Choices of /v1/chat/completions (``top_logprobs`` None: logprobs not asked)."""

    def _logprobs(self, ids: list[int], steps: list | None):
        if self.k is None or steps is None:
            return None
        return chat_logprobs(ids, steps, self.k, self.texts)

    def whole(self, c: CompletionOutput) -> dict:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": self._logprobs(c.token_ids, c.logprobs), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if self.token_ids:  # the prompt's ids are the response's (see the chat route)
            choice["token_ids"] = list(c.token_ids)
        return choice

    def delta(self, out: RequestOutput, c: CompletionOutput) -> dict | None:
        step = self._advance(c)
        if step is None:
            return None
        sent, piece, ids, steps = step
        sent.started = True
        delta = {"index": c.index, "delta": {"content": piece} if piece else {},
                 "logprobs": self._logprobs(ids, steps), "finish_reason": c.finish_reason,
                 "stop_reason": c.stop_reason}
        if self.token_ids:
            delta["token_ids"] = list(ids)
        return delta
