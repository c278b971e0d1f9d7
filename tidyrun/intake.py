"""Request intake: what a caller passes in (prompts, conversations, sampling params), checked and tokenized.

The LLM facade only routes. Every rule about what a request may hold lives
here, in one small object built from the three facts the rules depend on (the
tokenizer, the vocabulary size, the context length), so the rules can be
tested without an engine and a call is checked whole before anything of it is
queued.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, NamedTuple

from .errors import InvalidRequestError, PromptTooLongError
from .pooling_params import PoolingParams
from .sampling_params import BeamSearchParams, SamplingParams, truncation_ok
from .tokenizer import Tokenizer

PromptType = str | list[int] | dict
_PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
_EMPTY_OK = frozenset({"multi_modal_data", "mm_processor_kwargs", "multi_modal_uuids"})  # vLLM's, when empty


class Prompt(NamedTuple):
    """A tokenized prompt: its text (None when it came as token ids) and its token ids."""

    text: str | None
    token_ids: list[int]


def is_single_prompt(prompts) -> bool:
    """One prompt rather than a list of them: a text, a dict, or a list of token ids."""
    return (isinstance(prompts, (str, dict)) or getattr(prompts, "ndim", None) == 1  # a 1-D token id array
            or (isinstance(prompts, list) and bool(prompts) and _is_token(prompts[0])))


def _is_token(x) -> bool:
    """An int, or a NumPy / torch integer scalar (not an array, which also has ``__index__``)."""
    return isinstance(x, int) or (hasattr(type(x), "__index__") and getattr(x, "ndim", 0) == 0)


def token_id_list(ids, what: str) -> list[int]:
    """Token ids as a list of Python ints. NumPy and torch integers (a 1-D array, or a list of its items: verl
    passes ``list(ndarray)``) become ints, as vLLM takes them; what is not an integer is left for
    ``check_token_ids`` to refuse by name. Anything but a list, tuple or 1-D array is refused here."""
    if not isinstance(ids, (list, tuple)):
        if getattr(ids, "ndim", None) == 1 and hasattr(ids, "tolist"):  # numpy array, torch tensor
            return ids.tolist()
        raise InvalidRequestError(f"{what} must be a list of int, got {type(ids).__name__}")
    if all(type(t) is int for t in ids):  # the common case, without a call per token
        return list(ids)
    return [_as_int(t) for t in ids]


def _as_int(t):
    if isinstance(t, bool) or type(t).__name__ == "bool_" or str(getattr(t, "dtype", "")) == "torch.bool":
        return t  # refused by check_token_ids: a bool is no token id
    try:
        return operator.index(t)  # numpy.int64, torch.int64 scalars, ...
    except TypeError:
        return t


@dataclass(frozen=True)
class RequestIntake:
    """Checks requests against one engine's tokenizer, vocabulary and context length (``max_model_len``)."""

    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    max_logprobs: int = 20
    # SamplingParams fields of requests that bring none (the model's generation_config.json, as in vLLM).
    sampling_defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))

    def default_params(self) -> SamplingParams:
        """A new SamplingParams of this engine's defaults (``sampling_defaults`` over SamplingParams')."""
        return SamplingParams(**self.sampling_defaults)

    def tokenize(self, prompt: PromptType) -> Prompt:
        """Text and token ids of a prompt given as a str, a list of token ids or a dict (not yet checked)."""
        if isinstance(prompt, str):
            return Prompt(prompt, self.tokenizer.encode(prompt))
        if isinstance(prompt, dict):
            unknown = [k for k, v in prompt.items() if k not in _PROMPT_KEYS and not (k in _EMPTY_OK and not v)]
            if unknown:
                raise InvalidRequestError(f"a prompt dict takes 'prompt' and 'prompt_token_ids' (tidyrun runs "
                                          f"text-only models); got {sorted(map(str, unknown))}")
            if "prompt_token_ids" in prompt:
                return Prompt(prompt.get("prompt"), token_id_list(prompt["prompt_token_ids"], "'prompt_token_ids'"))
            if isinstance(prompt.get("prompt"), str):
                return Prompt(prompt["prompt"], self.tokenizer.encode(prompt["prompt"]))
            raise InvalidRequestError("a prompt dict needs 'prompt' (str) or 'prompt_token_ids' (list of int)")
        if isinstance(prompt, list) or getattr(prompt, "ndim", None) == 1:  # token ids (a NumPy / torch array too)
            return Prompt(None, token_id_list(prompt, "a token-id prompt"))
        raise InvalidRequestError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    def check_token_ids(self, ids: list[int], what: str) -> None:
        # vLLM's phrases ("cannot be empty", "out of vocabulary") first: code written against vLLM matches them
        if not ids:
            raise InvalidRequestError(f"{what.capitalize()} cannot be empty (the {what} is empty: 0 tokens)")
        vocab = self.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(f"{what} token id {bad[0]!r} is out of vocabulary: {what} token ids must be ints "
                                      f"in [0, {vocab})")

    def prompt(self, prompt: PromptType, truncate: int | None = None) -> Prompt:
        """A tokenized prompt that fits the context with room for at least one generated token.

        ``truncate`` (a request's ``truncate_prompt_tokens``) keeps only the last that many tokens (-1: the
        last ``max_model_len - 1``)."""
        tokenized = self.tokenize(prompt)
        ids = tokenized.token_ids
        self.check_token_ids(ids, "prompt")
        if truncate is not None:
            ids = _last_tokens(ids, truncate, self.max_model_len - 1)
            tokenized = Prompt(tokenized.text, ids)
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {len(ids)} tokens; this engine's context is {self.max_model_len} tokens "
                f"(max_model_len), which must also hold at least one generated token"
            )
        return tokenized

    def params(self, params: SamplingParams | None) -> SamplingParams:
        """A checked copy of ``params`` (None: the defaults) for one request, see ``SamplingParams.resolved``."""
        params = self.default_params() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        return params.resolved(self.vocab_size, self.max_logprobs, self.max_model_len, self._encode_word)

    def _encode_word(self, word: str) -> list[int]:
        return self.tokenizer.encode(word, add_special_tokens=False)

    def stream_request(self, prompt: PromptType, params: SamplingParams | None) -> tuple[Prompt, SamplingParams]:
        """A streamed request, checked like any other: one completion only."""
        prompt, params = self.request(prompt, params)
        if params.n != 1:
            raise InvalidRequestError("stream() supports n=1 only")
        return prompt, params

    def request(self, prompt: PromptType, params: SamplingParams | None) -> tuple[Prompt, SamplingParams]:
        params = self.params(params)
        return self.prompt(prompt, params.truncate_prompt_tokens), params

    def requests(self, prompts: PromptType | Iterable[PromptType],
                 params: SamplingParams | list[SamplingParams] | None) -> list[tuple[Prompt, SamplingParams]]:
        """Every (prompt, params) of a ``generate()`` call, all checked: one bad prompt rejects the whole call."""
        if is_single_prompt(prompts):
            prompts = [prompts]
        if not isinstance(prompts, Iterable):
            raise InvalidRequestError(f"prompts must be a str, a dict, a list of token ids or a list of those, "
                                      f"got {type(prompts).__name__}")
        prompts = list(prompts)
        if isinstance(params, list):
            if len(params) != len(prompts):
                raise InvalidRequestError(f"got {len(params)} sampling params for {len(prompts)} prompts")
            params_list = params
        else:
            params_list = [params] * len(prompts)
        return [self.request(p, sp) for p, sp in zip(prompts, params_list)]

    def conversations(self, messages: list[dict] | list[list[dict]], add_generation_prompt: bool = True, *,
                      continue_final_message: bool = False, chat_template: str | None = None,
                      tools: list[dict] | None = None, template_kwargs: dict | None = None,
                      content_format: str = "auto") -> list[dict]:
        """Prompts (``{"prompt": rendered text, "prompt_token_ids": ...}``) of one conversation or a list of them,
        through the chat template (the keyword arguments: see ``Tokenizer.render_chat``). A message's content is
        a string, None, or a list of OpenAI text parts (``{"type": "text", "text": ...}``); ``content_format`` is vLLM's
        ``chat_template_content_format``: "auto" / "string" give the template a string (text parts joined by
        newlines, None as ""), "openai" a list of text parts."""
        if content_format not in ("auto", "string", "openai"):
            raise InvalidRequestError(f"chat_template_content_format must be 'auto', 'string' or 'openai', got "
                                      f"{content_format!r}")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list of {'role', 'content'} dicts "
                                      "(or a list of such conversations)")
        if template_kwargs is not None and not isinstance(template_kwargs, dict):
            raise InvalidRequestError(f"chat_template_kwargs must be a dict, got {type(template_kwargs).__name__}")
        if tools is not None and not isinstance(tools, list):
            raise InvalidRequestError(f"tools must be a list of tool descriptions, got {type(tools).__name__}")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        conversations = [[_with_content(m, content_format) for m in c] if isinstance(c, list) else c
                         for c in conversations]
        texts = [self.tokenizer.render_chat(c, add_generation_prompt, continue_final_message=continue_final_message,
                                            chat_template=chat_template, tools=tools, template_kwargs=template_kwargs)
                 for c in conversations]
        # The rendered text rides along as the prompt's text (RequestOutput.prompt, as vLLM's chat() gives it);
        # the ids are its tokens without special tokens added (the template wrote them).
        return [{"prompt": t, "prompt_token_ids": self.tokenizer.encode(t, add_special_tokens=False)} for t in texts]

    def beam_prompts(self, prompts, params) -> list[list[int]]:
        """The token ids of ``beam_search``'s prompts (one or a list), each with room to grow, after checking
        ``params`` (a BeamSearchParams) against this engine's ``max_logprobs``."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"beam_search takes a BeamSearchParams, got {type(params).__name__}")
        params.check(self.max_logprobs)
        prompts = _prompt_list(prompts, "beam_search takes a prompt or a non-empty list of prompts")
        return [self.prompt(p).token_ids for p in prompts]

    def embed_inputs(self, texts: PromptType | list[PromptType], truncate: int | None = None) -> list[list[int]]:
        """Token ids of each input of ``embed()``: complete sequences, each at most ``max_model_len`` tokens
        (``truncate``, vLLM's ``truncate_prompt_tokens``: only the last that many; -1: ``max_model_len``)."""
        texts = _prompt_list(texts, "embed() takes a text, a token id list, or a non-empty list of those")
        if not truncation_ok(truncate):
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 or an int >= 1, got {truncate!r}")
        token_lists = []
        for t in texts:
            ids = self.tokenize(t).token_ids
            self.check_token_ids(ids, "input")
            if truncate is not None:
                ids = _last_tokens(ids, truncate, self.max_model_len)
            if len(ids) > self.max_model_len:
                raise PromptTooLongError(f"an input has {len(ids)} tokens; embed() takes at most "
                                         f"{self.max_model_len} (max_model_len)")
            token_lists.append(ids)
        return token_lists


def _prompt_list(prompts, wrong: str) -> list | tuple:
    """One prompt or a non-empty list (or tuple) of them, as a list or tuple; InvalidRequestError(``wrong``) else."""
    if is_single_prompt(prompts):
        return [prompts]
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise InvalidRequestError(wrong)
    return prompts


def _last_tokens(ids: list[int], truncate: int, fit: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: the last ``truncate`` of ``ids`` (-1: the last ``fit``, as many as the
    context takes: ``max_model_len - 1`` for a prompt that generates, ``max_model_len`` for pooling)."""
    keep = fit if truncate == -1 else truncate
    return ids[len(ids) - keep:] if len(ids) > keep else ids


def legacy_token_prompts(prompts, prompt_token_ids):
    """``generate``'s prompts, also from vLLM's older keyword ``prompt_token_ids`` (one list of ids, or a list of
    them; vLLM accepted it until 0.10 and RL code pinned to those versions still passes it): TokensPrompts."""
    if prompt_token_ids is None:
        if prompts is None:
            raise InvalidRequestError("generate() needs prompts (or vLLM's older prompt_token_ids=)")
        return prompts
    if prompts is not None:
        raise InvalidRequestError("generate() got both prompts and prompt_token_ids; pass one (token ids as "
                                  "prompts: [{'prompt_token_ids': ids}, ...])")
    if isinstance(prompt_token_ids, (list, tuple)) and prompt_token_ids and all(
            isinstance(ids, (list, tuple)) for ids in prompt_token_ids):
        return [{"prompt_token_ids": ids} for ids in prompt_token_ids]
    return {"prompt_token_ids": prompt_token_ids}  # one prompt; intake checks its ids


def check_no_priority(priority, num_prompts: int | None = None) -> None:
    """vLLM's ``generate(priority=)``: None, or one int per prompt (``num_prompts``, when known), all 0 (first
    come, first served)."""
    if priority is None:
        return
    if not isinstance(priority, (list, tuple)) or not all(isinstance(p, int) for p in priority):
        raise InvalidRequestError(f"priority must be None or a list of ints (one per prompt), got {priority!r}")
    if num_prompts is not None and len(priority) != num_prompts:
        raise InvalidRequestError(f"The lengths of prompts and priority must be the same: {num_prompts} prompts, "
                                  f"{len(priority)} priorities")
    if any(p != 0 for p in priority):
        raise InvalidRequestError(f"priority={list(priority)!r} is not supported: tidyrun schedules requests first "
                                  "come, first served (vLLM's default policy, which also refuses priorities); pass "
                                  "None")


def check_text_only(mm_processor_kwargs) -> None:
    if mm_processor_kwargs:
        raise InvalidRequestError(f"mm_processor_kwargs={mm_processor_kwargs!r} is not supported: tidyrun runs "
                                  "text-only models; pass None")


def score_pairs(data_1, data_2) -> tuple[list, list[tuple[int, int]]]:
    """vLLM's ``score`` pairing: one input against each of a list (1:N), or two lists of one length pair by pair
    (N:N). Returns the inputs in order and the pairs as (index, index) into them."""
    wrong = "score() takes a text (or token id list) or a non-empty list of them on each side"
    first, second = _prompt_list(data_1, wrong), _prompt_list(data_2, wrong)
    if len(first) == 1:
        return [first[0], *second], [(0, 1 + j) for j in range(len(second))]
    if len(first) != len(second):
        raise InvalidRequestError(f"score() pairs two lists item by item, but got {len(first)} and {len(second)} "
                                  "inputs; pass one input on the left to score it against each on the right")
    n = len(first)
    return [*first, *second], [(i, n + i) for i in range(n)]


def check_pooling_task(task, tokenization_kwargs=None) -> None:
    """vLLM's ``encode(pooling_task=, tokenization_kwargs=)`` checked: tidyrun pools each input's final hidden
    states into one vector (``llm.embed``), so None (vLLM's older default) and "embed" are that; tasks that
    need a classification or reward head, or a vector per token, are InvalidRequestError saying what there is."""
    if tokenization_kwargs not in (None, {}):
        raise InvalidRequestError(f"tokenization_kwargs={tokenization_kwargs!r} is not supported: pass "
                                  "truncate_prompt_tokens to cut inputs (tidyrun tokenizes as the model's tokenizer "
                                  "does)")
    if task is None or task == "embed":
        return
    if task in ("classify", "score", "token_classify", "reward"):
        raise InvalidRequestError(no_head(f"pooling_task={task!r}"))
    if task in ("token_embed", "encode"):
        raise InvalidRequestError(f"pooling_task={task!r} (a vector per token) is not supported: tidyrun pools each "
                                  "input into one vector; pass pooling_task='embed' (or call llm.embed)")
    raise InvalidRequestError(f"pooling_task must be 'embed' (or None), got {task!r}")


def no_head(what: str) -> str:
    """Why a classification, cross-encoder or reward output cannot be had (``pooling_task``, ``LLM.classify``)."""
    return (f"{what} needs a classification or reward head, which tidyrun's models do not have: tidyrun pools the "
            "final hidden states into embeddings (llm.embed, llm.encode(pooling_task='embed')) and llm.score "
            "compares them by cosine similarity")


def pooling_normalize(pooling_params, normalize: bool | None) -> bool:
    """Whether embeddings are scaled to unit length: vLLM's ``PoolingParams.normalize`` or tidyrun's
    ``normalize`` keyword (they must agree when both are given); True when neither says."""
    if pooling_params is not None:
        if not isinstance(pooling_params, PoolingParams):
            raise InvalidRequestError(f"pooling_params must be a PoolingParams, got {type(pooling_params).__name__}")
        pooling_params.check()
    theirs = None if pooling_params is None else pooling_params.normalize
    if normalize is not None and not isinstance(normalize, bool):
        raise InvalidRequestError(f"normalize must be True, False or None, got {normalize!r}")
    if normalize is not None and theirs is not None and normalize != theirs:
        raise InvalidRequestError(f"normalize={normalize} and pooling_params.normalize={theirs} disagree; pass one")
    return next((v for v in (normalize, theirs) if v is not None), True)


def _with_content(message, content_format: str):
    """``message`` with its content as the template gets it (``RequestIntake.conversations``); a message that is
    not a dict, or a content of another type, is left for the tokenizer to refuse."""
    if not isinstance(message, dict):
        return message
    content = message.get("content")
    if content is None:
        parts = []
    elif isinstance(content, str):
        if content_format != "openai":
            return message
        parts = [content]
    elif isinstance(content, list):
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(
                    f"a message content part must be {{'type': 'text', 'text': str}} (tidyrun runs text-only "
                    f"models), got {part!r}"[:300])
            parts.append(part["text"])
    else:
        return message
    text = [{"type": "text", "text": p} for p in parts] if content_format == "openai" else "\n".join(parts)
    return {**message, "content": text}
