"""Verification of draft tokens against the target model's logits at every draft position.

Greedy: accept drafts while they equal the argmax, then emit the argmax where
they differ (or a bonus token after the last draft): output identical to
plain greedy decoding. Sampling: a prompt-lookup draft is a point mass, so
draft d is accepted with probability p(d) and, when rejected, the token is
drawn from p with d removed, renormalised; this is standard speculative
sampling's residual rule for a deterministic proposal, so every emitted token
is distributed exactly as without speculation.
"""

from __future__ import annotations

import torch

from ..sampling import Sampler, draw
from ..sampling_params import SamplingParams


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """Greedy verification given the argmax ``targets`` at every draft position and after the last."""
    out = []
    for d, t in zip(drafts, targets):
        out.append(t)
        if t != d:
            return out
    out.append(targets[len(drafts)])
    return out


def verify_drafts(sampler: Sampler, logits: torch.Tensor, drafts: list[int], params: SamplingParams,
                  generator: torch.Generator | None) -> list[int]:
    """Tokens to append (1 to len(drafts) + 1) given float32 logits [len(drafts) + 1, vocab]."""
    if params.greedy:
        return accept_greedy(drafts, logits.argmax(dim=-1).tolist())
    probs = sampler.probabilities(logits, [params] * logits.shape[0])
    uniforms = torch.rand(len(drafts), generator=generator, device=logits.device).tolist()
    chosen = probs[torch.arange(len(drafts), device=logits.device), torch.tensor(drafts, device=logits.device)].tolist()
    out = []
    for i, d in enumerate(drafts):
        if uniforms[i] < chosen[i]:
            out.append(d)
            continue
        residual = probs[i].clone()
        residual[d] = 0.0
        out.append(int(draw(residual / residual.sum(), generator)))
        return out
    out.append(int(draw(probs[len(drafts)], generator)))
    return out
