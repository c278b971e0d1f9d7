"""Request bodies of the OpenAI-compatible API, and their translation to SamplingParams.

Field names, types and defaults follow OpenAI's API plus vLLM's extras
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
allowed_token_ids, bad_words, prompt_logprobs, structured_outputs,
guided_*, ...). Every body refuses fields it does not declare (400 naming
the field), and a declared field tidyrun cannot honour (tools, audio, ...)
is refused unless it holds its "off" value: a request is never answered as
if a field it sent had been applied when it was not. The only fields
accepted without effect are pure metadata (``user``, ``metadata``,
``service_tier``) and ``parallel_tool_calls`` (which means nothing without
tools).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..errors import InvalidRequestError
from ..sampling_params import SamplingParams, StructuredOutputsParams

MAX_N = 64  # choices per request: bounds the work one HTTP call can queue
MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs (chat) and, as in vLLM, on logprobs (completions)
LOGIT_BIAS_LIMIT = 100.0  # OpenAI: each bias is in [-100, 100]

_TOKEN_ID_KEY = re.compile(r"[0-9]+")


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


class _Body(BaseModel):
    """Unknown fields are refused, so a typo or an unsupported option never passes unnoticed."""

    model_config = ConfigDict(extra="forbid")


# -- structured outputs ---------------------------------------------------------------------


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``; ``strict`` is accepted (a constrained output always obeys)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def structured(self) -> StructuredOutputsParams | None:
        if self.type != "json_schema":
            if self.json_schema is not None:
                raise InvalidRequestError(f"response_format.json_schema is only allowed with type 'json_schema', "
                                          f"not {self.type!r}")
            return StructuredOutputsParams(json_object=True) if self.type == "json_object" else None
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise InvalidRequestError("response_format of type 'json_schema' needs json_schema.schema "
                                      "(the JSON schema the output must follow)")
        return StructuredOutputsParams(json=self.json_schema.schema_)


class StructuredOutputsRequest(_Body):
    """vLLM's ``structured_outputs`` field: the fields of StructuredOutputsParams."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    backend: str | None = None

    def params(self) -> StructuredOutputsParams:
        return StructuredOutputsParams(**self.model_dump(by_alias=True))


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


# -- the sampling fields both generation routes share ---------------------------------------


class _SamplingFields(_Body):
    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")
    response_format: ResponseFormat | None = None
    user: str | None = None  # metadata: accepted, no effect
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's token-level extras (RL and agent frameworks read them): the prompt's and each choice's token ids
    # beside the text, and logprob entries named "token_id:<id>" instead of token text
    return_token_ids: bool | None = None
    return_tokens_as_token_ids: bool | None = None
    # vLLM's add_special_tokens (a BOS the tokenizer adds, ...): None is vLLM's default per route, True for a
    # completion's text prompt, False for a rendered chat (its template writes them)
    add_special_tokens: bool | None = None

    def _check_common(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise InvalidRequestError(f"n must be between 1 and {MAX_N}, got {self.n}")
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequestError("truncate_prompt_tokens must be -1 (keep what fits) or >= 1, got 0")
        if self.stream and self.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs is not available with stream=true")

    def logit_bias_ids(self) -> dict[int, float] | None:
        """OpenAI's logit_bias (token id strings -> bias in [-100, 100]) keyed by int token id."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            if not _TOKEN_ID_KEY.fullmatch(key):
                raise InvalidRequestError(f"logit_bias keys must be token ids (decimal strings), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
                raise InvalidRequestError(f"logit_bias values must be in [-100, 100], got {value} for token {key}")
            bias[int(key)] = value
        return bias

    def structured(self) -> StructuredOutputsParams | None:
        """The one output constraint among response_format, structured_outputs and guided_* (at most one)."""
        guided = {k: getattr(self, f"guided_{k}") for k in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{k}") is not None}
        given = []
        if self.response_format is not None and self.response_format.type != "text":
            given.append("response_format")
        if self.structured_outputs is not None:
            given.append("structured_outputs")
        given += [f"guided_{k}" for k in guided]
        if len(given) > 1:
            raise InvalidRequestError(f"give one output constraint, not several: {', '.join(given)}")
        if self.response_format is not None:
            found = self.response_format.structured()
            if found is not None:
                return found
        if self.structured_outputs is not None:
            return self.structured_outputs.params()
        return StructuredOutputsParams(**guided) if guided else None

    def sampling_params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                        best_of: int | None = None) -> SamplingParams:
        """SamplingParams of this body (checked as they are built: a bad value raises InvalidRequestError)."""
        self._check_common()
        return SamplingParams(
            n=self.n, best_of=best_of, max_tokens=max_tokens, min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            logit_bias=self.logit_bias_ids(), allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            logprobs=logprobs, prompt_logprobs=prompt_logprobs, structured_outputs=self.structured(),
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


# -- /v1/completions ---------------------------------------------------------------------------


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="a prompt, a list of prompts, token ids, or a list of token id lists")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: score the prompt, generate nothing")
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | dict]:
        if self.suffix:
            raise InvalidRequestError("suffix is not supported by tidyrun")
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 is allowed only with echo=true)")
        return [x if isinstance(x, str) else {"prompt_token_ids": x} for x in split_inputs(self.prompt, "prompt")]

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """echo with logprobs shows the prompt's logprobs too, so the engine must compute them."""
        wanted = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None) if k is not None]
        return max(wanted) if wanted else None

    def params(self, max_tokens: int) -> SamplingParams:
        return self.sampling_params(max_tokens, self.logprobs, self.engine_prompt_logprobs, self.best_of)


# -- /v1/chat/completions ----------------------------------------------------------------------


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One message. Extra keys are ignored here (clients send a previous reply back whole, with
    ``refusal``/``annotations`` = null); ``tool_calls`` are refused, as tools are."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict] | None = None

    def as_template_message(self) -> dict:
        if self.tool_calls:
            raise InvalidRequestError("tools are not supported by tidyrun (a message carries tool_calls)")
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        role = "system" if self.role == "developer" else self.role
        return {"role": role, "content": content or ""}


class _ChatTemplateFields(_Body):
    """How a request's messages are rendered (the chat route's and /tokenize's): vLLM's chat extras, namely
    variables the template reads (Qwen3's enable_thinking), the last (assistant) message left open for the
    model to continue, and a template of the request's own (only on a server started with
    --trust-request-chat-template, as in vLLM: a template is code the server runs)."""

    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    chat_template: str | None = None


class ChatCompletionRequest(_SamplingFields, _ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # OpenAI fields tidyrun cannot honour: refused unless "off" (see _refuse_unsupported)
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict] | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    reasoning_effort: str | None = None
    web_search_options: dict | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None  # metadata: accepted, no effect
    service_tier: str | None = None  # metadata: accepted, no effect (tidyrun has one tier)

    def _refuse_unsupported(self) -> None:
        if self.tools or self.functions:
            raise InvalidRequestError(f"tools are not supported by tidyrun ({'tools' if self.tools else 'functions'} "
                                      "given)")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise InvalidRequestError(f"tools are not supported by tidyrun ({name} must be 'none' or absent)")
        if self.modalities is not None and self.modalities != ["text"]:
            raise InvalidRequestError(f"modalities: tidyrun produces text only, got {self.modalities}")
        for name in ("audio", "prediction", "reasoning_effort", "web_search_options"):
            if getattr(self, name) is not None:
                raise InvalidRequestError(f"{name} is not supported by tidyrun")
        if self.store:
            raise InvalidRequestError("store is not supported by tidyrun (completions are not stored)")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs=true")

    def conversation(self) -> list[dict]:
        self._refuse_unsupported()
        return [m.as_template_message() for m in self.messages]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """Top alternatives per token (None: no logprobs at all; 0: the sampled token's only)."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def params(self, max_tokens: int) -> SamplingParams:
        self._refuse_unsupported()
        return self.sampling_params(max_tokens, self.num_top_logprobs, self.prompt_logprobs)


# -- other routes ------------------------------------------------------------------------------


class UpdateWeightsRequest(_Body):
    path: str = Field(description="a .safetensors file or a folder of them, with Hugging Face tensor names; "
                                  "relative paths are taken from the server's --weights-dir, and the path must "
                                  "resolve (links followed) inside it")
    check_finite: bool = Field(False, description="refuse the update if any tensor holds a NaN or an infinity "
                                                  "(a diverged training step); costs one pass over the data")


class EmbeddingRequest(_Body):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None  # metadata: accepted, no effect
    pooling: Literal["last", "mean", "cls"] = "last"  # tidyrun extra
    normalize: bool = True  # tidyrun extra

    def inputs(self) -> list[str | list[int]]:
        if self.dimensions is not None:
            raise InvalidRequestError("dimensions is not supported by tidyrun")
        return split_inputs(self.input, "input")


class TokenizeRequest(_ChatTemplateFields):
    """vLLM's POST /tokenize: a text ``prompt`` (special tokens added by default), or chat ``messages``
    rendered with the chat template first (special tokens not added by default: the template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("tokenize needs exactly one of prompt (text) or messages (a chat)")


class DetokenizeRequest(_Body):
    """vLLM's POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]
