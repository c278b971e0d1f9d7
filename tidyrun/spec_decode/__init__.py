"""Speculative decoding: n-gram prompt-lookup drafts, verified by the target model in one pass."""

from .ngram import NgramProposer
from .verify import accept_greedy, verify_drafts

__all__ = ("NgramProposer", "accept_greedy", "verify_drafts")
