"""SamplingParams (vLLM-compatible names) and the sampler that applies them to logits."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .errors import InvalidRequestError

# Temperatures below this are treated as greedy (exact argmax), as in vLLM.
_GREEDY_EPS = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens for one request. Validated on construction; immutable after."""

    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] | str | None = None
    stop_token_ids: tuple[int, ...] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        elif isinstance(stop, (list, tuple)) and all(isinstance(s, str) for s in stop):
            stop = tuple(stop)
        else:
            raise InvalidRequestError(f"stop must be a string or a list of strings, got {stop!r}")
        if any(s == "" for s in stop):
            raise InvalidRequestError("stop strings must not be empty")
        object.__setattr__(self, "stop", stop)
        ids = self.stop_token_ids or ()
        if not isinstance(ids, (list, tuple)) or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise InvalidRequestError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", tuple(ids))
        self._validate()

    def _validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(f"invalid sampling parameter: {msg}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_int(self.n) or self.n < 1:
            raise bad(f"n must be an int >= 1, got {self.n!r}")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad(f"max_tokens must be an int >= 1 or None, got {self.max_tokens!r}")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad(f"min_tokens must be an int >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature < float("inf"):
            raise bad(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad(f"top_k must be -1, 0 (disabled) or a positive int, got {self.top_k!r}")
        if not isinstance(self.min_p, (int, float)) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            raise bad(f"seed must be an int in [0, 2**63) or None, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


class Sampler:
    """Turns a batch of logits into one token per row.

    Greedy rows are an exact argmax. Other rows are scaled by temperature,
    filtered by top-k, then top-p, then min-p (each on the distribution the
    previous filter left, as transformers does), and sampled with the row's own
    ``torch.Generator`` so a seeded request draws the same tokens whatever
    else is in the batch. Holds no device memory between calls.
    """

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> torch.Tensor:
        tokens = logits.argmax(dim=-1)
        rows = [i for i, p in enumerate(params) if not p.greedy]
        if not rows:
            return tokens
        probs, order = self._sorted_filtered(logits[rows], [params[i] for i in rows])
        picks = torch.stack([draw(probs[j], generators[i]) for j, i in enumerate(rows)])
        tokens[rows] = order[torch.arange(len(rows), device=logits.device), picks]
        return tokens

    def probabilities(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution [rows, vocab] each (non-greedy) row samples from, after all filters."""
        probs, order = self._sorted_filtered(logits, params)
        return torch.zeros_like(probs).scatter_(-1, order, probs)

    @staticmethod
    def _sorted_filtered(sub: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
        dev = sub.device
        temps = torch.tensor([p.temperature for p in params], device=dev, dtype=sub.dtype)
        sorted_logits, order = (sub / temps[:, None]).sort(dim=-1, descending=True)
        rank = torch.arange(sorted_logits.shape[-1], device=dev)[None, :]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else sub.shape[-1] for p in params], device=dev)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=sub.dtype)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays).
        sorted_logits = sorted_logits.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], float("-inf"))
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=sub.dtype)
        probs = sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
        return sorted_logits.softmax(dim=-1), order


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index drawn from ``probs`` (1-D) with ``generator``: the exponential race argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()
