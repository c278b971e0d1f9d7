"""What generate() returns, shaped like vLLM's RequestOutput/CompletionOutput (same fields, same order)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .logprobs import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None  # sum of the sampled tokens' logprobs; None unless logprobs asked
    logprobs: SampleLogprobs | None = None  # one {token id: Logprob} per generated token, if asked
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    lora_request: None = None  # vLLM's field; tidyrun has no LoRA adapters

    def finished(self) -> bool:
        """A method, as in vLLM (``RequestOutput.finished`` is not)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None = None
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: None = None  # vLLM's fields with no counterpart here: always None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None

    @property
    def finished(self) -> bool:
        return all(o.finished() for o in self.outputs)


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """One input's embedding, as vLLM's ``LLM.embed`` returns it (``.outputs.embedding``)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class PoolingOutput:
    """vLLM's ``PoolingOutput``: the pooled vector as a tensor (float32, on the CPU)."""

    data: torch.Tensor


@dataclass
class PoolingRequestOutput:
    """One input's pooled output, as vLLM's ``LLM.encode`` returns it (``.outputs.data``)."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """One pair's score, as vLLM's ``LLM.score`` returns it (``.outputs.score``); ``prompt_token_ids`` are
    the pair's two inputs' ids, the pad token between them (as vLLM's)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


def embedding_outputs(prefix: str, token_lists: list[list[int]], vectors) -> list[EmbeddingRequestOutput]:
    """``vectors`` [N, hidden] (the runner's pooled rows) as vLLM's outputs, ids ``prefix-0`` ...``prefix-(N-1)``."""
    return [EmbeddingRequestOutput(f"{prefix}-{i}", EmbeddingOutput(v), ids)
            for i, (ids, v) in enumerate(zip(token_lists, vectors.tolist()))]


def pooling_outputs(prefix: str, token_lists: list[list[int]], vectors: torch.Tensor) -> list[PoolingRequestOutput]:
    """``vectors`` [N, hidden] as vLLM's ``encode`` outputs (each row its own tensor), ids as ``embedding_outputs``."""
    return [PoolingRequestOutput(f"{prefix}-{i}", PoolingOutput(v.clone()), ids)
            for i, (ids, v) in enumerate(zip(token_lists, vectors))]


def scoring_outputs(prefix: str, token_lists: list[list[int]], vectors, pairs: list[tuple[int, int]],
                    separator: list[int]) -> list[ScoringRequestOutput]:
    """Cosine similarity of each pair (i, j) of rows of ``vectors`` (unit length already) as vLLM's outputs; a
    pair's ``prompt_token_ids`` are its two inputs' with ``separator`` (vLLM's: the pad token) between."""
    left = vectors[[i for i, _ in pairs]]
    right = vectors[[j for _, j in pairs]]
    scores = (left * right).sum(-1).tolist()
    return [ScoringRequestOutput(f"{prefix}-{k}", ScoringOutput(score), token_lists[i] + separator + token_lists[j])
            for k, ((i, j), score) in enumerate(zip(pairs, scores))]
