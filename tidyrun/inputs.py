"""vLLM's prompt types (``vllm.inputs``): typed dicts, so ``TokensPrompt(prompt_token_ids=ids)`` is the dict
tidyrun's ``generate`` already takes. Keys tidyrun has no use for (multi-modal data) are refused when the
prompt is submitted."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt as token ids (``prompt``: its text, if the caller has it; shown in ``RequestOutput.prompt``)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]


__all__ = ("TextPrompt", "TokensPrompt")
