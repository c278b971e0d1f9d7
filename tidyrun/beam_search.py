"""vLLM's offline beam search (``LLM.beam_search``), built on the engine's own one-token steps.

Each round asks the engine for one token of every live beam with its top
``2 * beam_width`` logprobs (greedy, or at ``temperature``; the logprobs are
the raw distribution's), extends every beam by each candidate, and keeps the
``beam_width`` best per prompt by ``score``; a beam that ends in an EOS id
moves to the finished ones (unless ``ignore_eos``). The beams of one prompt
share its prefix, so the prefix cache serves each round's prompts but their
last token. Same rules and score as vLLM's offline beam search: the EOS is
the tokenizer's ``eos_token_id`` alone, the score ``cum_logprob / len **
length_penalty`` with the length counting the prompt and not a final EOS,
``text`` the decoded prompt and generated tokens (special tokens kept), and
``finish_reason`` / ``stop_reason`` left None.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .errors import InvalidRequestError
from .logprobs import Logprob
from .sampling_params import BeamSearchParams, SamplingParams


@dataclass
class BeamSearchSequence:
    """One beam: ``tokens`` the prompt's and the generated ones, ``logprobs`` one {token id: Logprob} per
    generated token (its candidates), ``text`` the decoded ``tokens`` (set on the returned beams)."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None  # vLLM's fields, left None by its offline beam search (and here)
    stop_reason: int | str | None = None
    lora_request: None = None


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def score(beam: BeamSearchSequence, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(beam.tokens) - (1 if beam.tokens and beam.tokens[-1] == eos_token_id else 0)
    return beam.cum_logprob / (max(length, 1) ** length_penalty)


def beam_search(generate: Callable, prompts: list[list[int]], params: BeamSearchParams, eos_token_id: int | None,
                max_model_len: int, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
    """``generate(token id prompts, SamplingParams)`` -> RequestOutputs in order (the engine's ``generate``)."""
    width = params.beam_width
    step = SamplingParams(max_tokens=1, temperature=params.temperature, logprobs=2 * width, ignore_eos=True)
    key = lambda b: score(b, eos_token_id, params.length_penalty)  # noqa: E731
    live = [[BeamSearchSequence(list(p))] for p in prompts]
    done: list[list[BeamSearchSequence]] = [[] for _ in prompts]
    for _ in range(params.max_tokens):
        beams = [b for group in live for b in group]
        if not beams:
            break
        results = iter(generate([{"prompt_token_ids": b.tokens} for b in beams], step))
        for i, group in enumerate(live):
            grown = []
            for beam in group:
                candidates = next(results).outputs[0].logprobs[0]
                for token, logprob in candidates.items():
                    new = BeamSearchSequence(beam.tokens + [token], beam.logprobs + [candidates],
                                             beam.cum_logprob + logprob.logprob)
                    ended = token == eos_token_id and not params.ignore_eos
                    # a beam with no room for another token ends where it is (vLLM would fail the next round)
                    (done[i] if ended or len(new.tokens) >= max_model_len else grown).append(new)
            live[i] = sorted(grown, key=key, reverse=True)[:width]
    outputs = []
    for i, group in enumerate(live):
        best = sorted(done[i] + group, key=key, reverse=True)[:width]
        for beam in best:
            beam.text = decode(beam.tokens)
        outputs.append(BeamSearchOutput(best))
    return outputs
