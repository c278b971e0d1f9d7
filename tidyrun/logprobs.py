"""Logprob, as vLLM returns it: ``output.logprobs[t][token_id].logprob`` / ``.rank`` / ``.decoded_token``."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """One token's log-probability (or logit, in a ``*_logits`` mode), its 1-based rank in the
    vocabulary (1 = most likely) and its text (None when the request asked for ``detokenize=False``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: {token id: Logprob} holding the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]]
# Per prompt token: None for the first (nothing predicts it), then {token id: Logprob}.
PromptLogprobs = list[dict[int, Logprob] | None]
