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


def to_logprob_dict(record, decode) -> dict[int, Logprob]:
    """{token id: Logprob} of one record (token, value, rank, top ids, top values): the token first, then the
    top-k with ranks 1..k (the token appears once). ``decode(id)`` gives a token's text, or None."""
    token, value, rank, top_ids, top_values = record
    out = {token: Logprob(value, rank, decode(token))}
    for r, (t, v) in enumerate(zip(top_ids, top_values), start=1):
        if t not in out:
            out[t] = Logprob(v, r, decode(t))
    return out


def sample_logprobs(records, decode) -> SampleLogprobs:
    return [to_logprob_dict(r, decode) for r in records]


def prompt_logprobs(records, decode) -> PromptLogprobs:
    return [None if r is None else to_logprob_dict(r, decode) for r in records]
