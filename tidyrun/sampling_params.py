"""SamplingParams and StructuredOutputsParams: vLLM's names, types and semantics.

Users port vLLM code by changing the import (``from tidyrun.sampling_params
import SamplingParams, StructuredOutputsParams``). Like vLLM's, the objects
are mutable (verl sets attributes between rollouts) and are checked when
built *and* again when a request is submitted: the engine takes a checked
copy (``resolved``), so changing the caller's object later never changes a
request already in flight.
"""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from .errors import InvalidRequestError

# Temperatures below this are treated as greedy (exact argmax), as in vLLM.
_GREEDY_EPS = 1e-5


class RequestOutputKind(enum.IntEnum):
    """vLLM's output kinds. Offline ``generate`` always returns the final output; streaming uses deltas."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


def _bad(msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid sampling parameter: {msg}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def truncation_ok(v) -> bool:
    """A valid ``truncate_prompt_tokens`` (sampling's and pooling's): None, -1 (as many as fit) or an int >= 1."""
    return v is None or (_is_int(v) and (v == -1 or v >= 1))


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


@dataclass
class StructuredOutputsParams:
    """Constrain a completion to a JSON schema, a regular expression, one of a list of choices, or a
    grammar (Lark / EBNF, as the grammar library reads it); exactly one of them.

    ``json`` takes a schema as a dict or a JSON string; ``json_object=True``
    asks for any JSON object. ``disable_any_whitespace`` makes JSON compact.
    ``backend`` / ``disable_fallback`` / ``whitespace_pattern`` are accepted
    for vLLM compatibility (tidyrun has one backend).
    """

    json: str | dict | None = None
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

    def __post_init__(self) -> None:
        self.validate()

    @property
    def kind(self) -> str:
        """Which constraint is set: "json", "regex", "choice", "grammar", "json_object" or "structural_tag"."""
        return next(k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                    if getattr(self, k) not in (None, False))

    def validate(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
                 if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise InvalidRequestError(
                "structured outputs need exactly one of json, regex, choice, grammar, json_object or "
                f"structural_tag; got {kinds or 'none'}")
        if self.structural_tag is not None:
            raise InvalidRequestError("structured outputs: structural_tag is not supported by tidyrun; "
                                      "use json, regex, choice or grammar")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise InvalidRequestError(f"structured outputs: json must be a schema (dict or JSON string), "
                                      f"got {type(self.json).__name__}")
        if self.regex is not None and not isinstance(self.regex, str):
            raise InvalidRequestError(f"structured outputs: regex must be a string, got {type(self.regex).__name__}")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise InvalidRequestError("structured outputs: grammar must be a string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) for c in self.choice)):
                raise InvalidRequestError("structured outputs: choice must be a non-empty list of strings")
        if self.backend not in (None, "auto", "guidance", "llguidance", "xgrammar", "outlines"):
            raise InvalidRequestError(f"structured outputs: unknown backend {self.backend!r}")


# vLLM's earlier name (TRL < 0.22 and many scripts import it), same fields.
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to pick tokens for one request, with vLLM's fields and defaults.

    Penalties follow vLLM: ``repetition_penalty`` (> 0, 1 = off) divides
    positive and multiplies negative logits of tokens seen in the prompt or
    the output; ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2])
    subtract once per seen output token / per occurrence. ``logprobs=k``
    returns, per generated token, the sampled token's log-probability and the
    k most likely tokens' (``0``: the sampled token only; ``-1``: the whole
    vocabulary); ``prompt_logprobs`` does the same for the prompt's tokens;
    ``flat_logprobs=True`` returns both as ``FlatLogprobs`` (read the same way).
    ``best_of`` must equal ``n`` (as in vLLM v1). ``logits_processors`` (per
    request callables) are refused, as in vLLM v1.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    flat_logprobs: bool = False  # logprobs as one FlatLogprobs (six flat lists) instead of a list of dicts
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: Any = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's earlier name for structured_outputs
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    extra_args: dict[str, Any] | None = None
    skip_reading_prefix_cache: bool | None = None  # True: recompute the whole prompt (None: only for prompt_logprobs)
    # Filled by ``resolved``: token id sequences of ``bad_words`` (each word with and without a leading space).
    bad_words_token_ids: list[list[int]] | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.validate()

    # -- checks ---------------------------------------------------------------------------

    def validate(self) -> None:
        """Normalise (``stop`` to a list, ``guided_decoding`` to ``structured_outputs``) and check every field."""
        self._normalise()
        if not _is_int(self.n) or self.n < 1:
            raise _bad(f"n must be an int >= 1, got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            raise _bad(f"best_of must equal n (got best_of={self.best_of!r}, n={self.n}); like vLLM v1, "
                       "tidyrun returns every sample it draws")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not _is_number(v) or not -2.0 <= v <= 2.0:
                raise _bad(f"{name} must be in [-2, 2], got {v!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise _bad(f"repetition_penalty must be a number > 0, got {self.repetition_penalty!r}")
        if not _is_number(self.temperature) or self.temperature < 0.0:
            raise _bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise _bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise _bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not -2**63 <= self.seed < 2**64):
            raise _bad(f"seed must be an int or None, got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < -1):
                raise _bad(f"{name} must be None, -1 (the whole vocabulary) or an int >= 0, got {v!r}")
        if not truncation_ok(self.truncate_prompt_tokens):
            raise _bad(f"truncate_prompt_tokens must be None, -1 or an int >= 1, got {self.truncate_prompt_tokens!r}")
        if self.logits_processors:
            raise _bad("per-request logits_processors are not supported (as in vLLM v1); use logit_bias, "
                       "allowed_token_ids, bad_words or structured_outputs")
        if not self.detokenize and self.stop:
            raise _bad("stop strings need detokenize=True")
        for name in ("ignore_eos", "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
                     "include_stop_str_in_output", "flat_logprobs"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(f"{name} must be a bool, got {getattr(self, name)!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or not all(
                    _is_number(b) and _is_int(_token_key(t)) for t, b in self.logit_bias.items()):
                raise _bad("logit_bias must map token ids to finite numbers")
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise _bad("allowed_token_ids must be a non-empty list of token ids")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or not all(isinstance(w, str) and w.strip() for w in self.bad_words)):
            raise _bad("bad_words must be a list of non-empty strings")
        if self.structured_outputs is not None:
            if not isinstance(self.structured_outputs, StructuredOutputsParams):
                raise _bad("structured_outputs must be a StructuredOutputsParams")
            self.structured_outputs.validate()
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise _bad("extra_args must be a dict")
        if self.skip_reading_prefix_cache not in (None, True, False):
            raise _bad(f"skip_reading_prefix_cache must be a bool or None, got {self.skip_reading_prefix_cache!r}")

    def _normalise(self) -> None:
        stop = self.stop
        if stop is None:
            stop = []
        elif isinstance(stop, str):
            stop = [stop]
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = list(stop)
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise InvalidRequestError("stop strings must not be empty")
        self.stop = stop
        ids = [] if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or not all(_is_int(i) and i >= 0 for i in ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(ids)
        if self.guided_decoding is not None:
            if self.structured_outputs is not None and self.structured_outputs is not self.guided_decoding:
                raise _bad("give structured_outputs or guided_decoding (its earlier name), not both")
            self.structured_outputs = self.guided_decoding
        if not isinstance(self.output_kind, RequestOutputKind):
            try:
                self.output_kind = RequestOutputKind(self.output_kind)
            except ValueError:
                raise _bad(f"unknown output_kind {self.output_kind!r}") from None

    def resolved(self, vocab_size: int, max_logprobs: int, max_model_len: int, encode=None) -> SamplingParams:
        """A checked copy for one request: the engine keeps it, the caller may change its own object.

        Checks what needs the engine (token ids below ``vocab_size``, logprobs
        counts up to ``max_logprobs`` (-1: no limit), truncation within
        ``max_model_len``) and tokenizes ``bad_words`` with ``encode``.
        """
        params = copy.copy(self)
        params.stop = list(self.stop or []) if not isinstance(self.stop, str) else self.stop
        params.validate()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(params, name)
            if v == -1:  # the whole vocabulary, which max_logprobs then has to allow (as in vLLM)
                v = vocab_size
                setattr(params, name, v)
            if v is not None and max_logprobs != -1 and v > max_logprobs:
                raise _bad(f"{name}={v} exceeds this engine's max_logprobs ({max_logprobs}); "
                           "raise it with LLM(max_logprobs=...) (-1: no limit)")
            if v is not None and v > vocab_size:
                raise _bad(f"{name}={v} exceeds the vocabulary size ({vocab_size})")
        if any(t >= vocab_size for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size ({vocab_size})")
        if params.logit_bias:
            bias = {_token_key(t): float(b) for t, b in params.logit_bias.items()}
            if any(not 0 <= t < vocab_size for t in bias):
                raise _bad(f"logit_bias token ids must be in [0, {vocab_size})")
            params.logit_bias = bias
        if params.allowed_token_ids is not None:
            if any(t >= vocab_size for t in params.allowed_token_ids):
                raise _bad(f"allowed_token_ids must be below the vocabulary size ({vocab_size})")
            params.allowed_token_ids = list(params.allowed_token_ids)
        if params.truncate_prompt_tokens is not None and params.truncate_prompt_tokens > max_model_len:
            raise _bad(f"truncate_prompt_tokens ({params.truncate_prompt_tokens}) exceeds max_model_len "
                       f"({max_model_len})")
        if params.bad_words:
            if encode is None:
                raise _bad("bad_words need a tokenizer")
            words = []
            for word in params.bad_words:
                for variant in (word, " " + word.lstrip()):
                    ids = list(encode(variant))
                    if ids and ids not in words:
                        words.append(ids)
            params.bad_words_token_ids = words
        return params

    def clone(self) -> SamplingParams:
        return copy.deepcopy(self)

    # -- derived --------------------------------------------------------------------------

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def processes_logits(self) -> bool:
        """Whether anything besides temperature/top-k/top-p/min-p changes this request's logits."""
        return self.processes_besides_grammar or self.structured_outputs is not None

    @property
    def processes_besides_grammar(self) -> bool:
        """``processes_logits`` leaving out a structured-outputs mask (penalties, bias, allowed ids, bad words)."""
        return bool(self.has_penalties or self.logit_bias or self.allowed_token_ids is not None
                    or self.bad_words_token_ids)

    @classmethod
    def from_optional(cls, **kwargs) -> SamplingParams:
        """vLLM's constructor that treats None as "the default"."""
        return cls(**{k: v for k, v in kwargs.items() if v is not None})


def _token_key(t):
    """A logit_bias key as an int (JSON bodies carry them as strings)."""
    if isinstance(t, str):
        try:
            return int(t)
        except ValueError:
            return t
    return t


@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def check(self, max_logprobs: int) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                raise InvalidRequestError(f"BeamSearchParams.{name} must be an int >= 1, got {value!r}")
        if max_logprobs != -1 and 2 * self.beam_width > max_logprobs:
            raise InvalidRequestError(f"beam_width={self.beam_width} needs {2 * self.beam_width} logprobs per token, "
                                      f"above this engine's max_logprobs ({max_logprobs}); raise LLM(max_logprobs=)")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidRequestError(f"BeamSearchParams.temperature must be >= 0, got {self.temperature!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise InvalidRequestError(f"BeamSearchParams.length_penalty must be a number, got {self.length_penalty!r}")
