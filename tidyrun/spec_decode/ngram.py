"""Prompt-lookup drafts: if the last n tokens occurred before, propose what followed them then.

No draft model and no device memory: a host-side search over the sequence's
own tokens, which pays off on repetitive text (code edits, quoting, summaries).
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_max: int, prompt_lookup_min: int = 1) -> None:
        self.k = num_speculative_tokens
        self.n_max = prompt_lookup_max
        self.n_min = prompt_lookup_min

    def propose(self, tokens: Sequence[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` tokens that followed the latest earlier occurrence of the longest
        matching suffix (longest n first)."""
        k = min(self.k, limit)
        if k <= 0:
            return []
        length = len(tokens)
        for n in range(min(self.n_max, length - 1), self.n_min - 1, -1):
            suffix = list(tokens[length - n:])
            # Latest start i < length - n with tokens[i:i+n] == suffix.
            for i in range(length - n - 1, -1, -1):
                if tokens[i] == suffix[0] and list(tokens[i:i + n]) == suffix:
                    follow = list(tokens[i + n:i + n + k])
                    if follow:
                        return follow
                    break
        return []
