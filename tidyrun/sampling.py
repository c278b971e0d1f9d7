"""The sampler: turns a batch of (processed) logits into tokens. ``SamplingParams`` lives in sampling_params.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sampling_params import SamplingParams


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

    def filtered_logits(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The temperature-scaled logits [rows, vocab] each (non-greedy) row samples from: -inf where top-k,
        top-p or min-p removed a token. Their softmax is ``probabilities``; unlike the probabilities, they
        keep every surviving token's value however unlikely (no underflow to 0)."""
        probs, order, scaled = self._sorted_filtered(logits, params, keep_logits=True)
        return torch.full_like(scaled, float("-inf")).scatter_(-1, order, scaled)

    @staticmethod
    def _sorted_filtered(sub: torch.Tensor, params: Sequence[SamplingParams], keep_logits: bool = False):
        dev = sub.device
        temps = torch.tensor([p.temperature for p in params], device=dev, dtype=sub.dtype)
        sorted_logits, order = (sub / temps[:, None]).sort(dim=-1, descending=True)
        rank = torch.arange(sorted_logits.shape[-1], device=dev)[None, :]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else sub.shape[-1] for p in params], device=dev)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=dev, dtype=sub.dtype)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays). Rows with
        # top_p = 1 keep everything: their cumulative sum can round to 1 before the tail.
        drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        min_p = torch.tensor([p.min_p for p in params], device=dev, dtype=sub.dtype)
        probs = sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
        if keep_logits:
            return sorted_logits.softmax(dim=-1), order, sorted_logits
        return sorted_logits.softmax(dim=-1), order


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index drawn from ``probs`` (1-D) with ``generator``: the exponential race argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()


def logprob_records(scores: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int],
                    shift: torch.Tensor | None = None) -> list[tuple[int, float, int, list[int], list[float]]]:
    """Per row: (token, its score, its 1-based rank, the top-k ids, their scores), k = ``ks[row]``.

    ``scores`` [rows, vocab] are log-probabilities or logits; ``shift`` (a row's
    logsumexp) turns logits into log-probabilities without materialising
    ``log_softmax`` over the vocabulary (ranks and top-k do not change).
    Everything is computed on the scores' device and comes to the host in
    one copy, whatever the number of rows.
    """
    value = scores.gather(1, tokens[:, None])[:, 0]
    rank = (scores > value[:, None]).sum(-1)
    k = max(ks)
    top_values, top_ids = scores.topk(k, dim=-1) if k else (scores[:, :0], tokens[:, None][:, :0])
    if shift is not None:
        value, top_values = value - shift, top_values - shift[:, None]
    # float64 holds every token id and rank exactly (< 2**53): one tensor, one copy to the host.
    packed = torch.cat([tokens[:, None].double(), value[:, None].double(), rank[:, None].double() + 1,
                        top_ids.double(), top_values.double()], dim=1).tolist()
    return [(int(row[0]), row[1], int(row[2]), [int(t) for t in row[3:3 + n]], row[3 + k:3 + k + n])
            for row, n in zip(packed, ks)]
