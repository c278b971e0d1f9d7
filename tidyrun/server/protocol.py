"""Request bodies of the OpenAI-compatible API, and their translation to SamplingParams.

Field names and defaults follow OpenAI's API, plus vLLM's sampling extras
(top_k, min_p, min_tokens, ignore_eos, stop_token_ids, ...). Features
tidyrun does not implement (logprobs, echo, penalties) are refused with a
clear 400 instead of being silently ignored.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams

MAX_N = 64  # choices per request: bounds the work one HTTP call can queue


def split_inputs(value, field: str) -> list[str | list[int]]:
    """OpenAI's prompt/input union (a string, strings, token ids, lists of token ids) as a list of items."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise InvalidRequestError(f"{field} must not be empty")
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    if all(isinstance(x, str) for x in value) or all(isinstance(x, list) for x in value):
        return [x if isinstance(x, str) else list(x) for x in value]
    raise InvalidRequestError(f"{field} must be a string, a list of strings, or (lists of) token ids")


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream_options: dict | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def _refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise InvalidRequestError(f"{name} is not supported by tidyrun")
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {self.n}")

    def sampling_params(self, max_tokens: int | None) -> SamplingParams:
        self._refuse_unsupported()
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a prompt, a list of prompts, token ids, or a list of token id lists")
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def prompts(self) -> list[str | dict]:
        if self.logprobs is not None:
            raise InvalidRequestError("logprobs is not supported by tidyrun")
        if self.echo:
            raise InvalidRequestError("echo is not supported by tidyrun")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by tidyrun")
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in split_inputs(self.prompt, "prompt")]


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None

    def as_template_message(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def conversation(self) -> list[dict]:
        if self.logprobs or self.top_logprobs:
            raise InvalidRequestError("logprobs is not supported by tidyrun")
        return [m.as_template_message() for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class UpdateWeightsRequest(BaseModel):
    path: str = Field(description="a .safetensors file or a folder of them, with Hugging Face tensor names")


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    pooling: Literal["last", "mean", "cls"] = "last"  # tidyrun extra
    normalize: bool = True  # tidyrun extra

    def inputs(self) -> list[str | list[int]]:
        if self.dimensions is not None:
            raise InvalidRequestError("dimensions is not supported by tidyrun")
        return split_inputs(self.input, "input")
