"""Logprob, as vLLM returns it: ``output.logprobs[t][token_id].logprob`` / ``.rank`` / ``.decoded_token``."""

from __future__ import annotations

from collections.abc import MutableSequence
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability (or logit, in a ``*_logits`` mode), its 1-based rank in the
    vocabulary (1 = most likely) and its text (None when the request asked for ``detokenize=False``)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class FlatLogprobs(MutableSequence):
    """A request's logprobs as six flat lists (vLLM's ``SamplingParams(flat_logprobs=True)``): a long rollout's
    records stay a handful of objects for the garbage collector instead of a dict and a Logprob per entry.
    Reads as the list of dicts does (``lp[t][token].logprob``, ``len``, iteration, slices): position ``i``
    holds entries ``start_indices[i]`` to ``end_indices[i]`` (excluded), its sampled (or prompt) token
    first. The first prompt position, None in the list form, is an empty range here (``{}``), as in vLLM.
    Append-only: replacing or removing a position raises TypeError."""

    start_indices: list[int] = field(default_factory=list)
    end_indices: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    ranks: list[int | None] = field(default_factory=list)
    decoded_tokens: list[str | None] = field(default_factory=list)

    def append(self, position: dict[int, Logprob] | None) -> None:
        """Add the next position ({token id: Logprob}; None: no entries)."""
        self.start_indices.append(len(self.token_ids))
        for token, lp in (position or {}).items():
            self._add(token, lp.logprob, lp.rank, lp.decoded_token)
        self.end_indices.append(len(self.token_ids))

    def append_record(self, record, decode) -> None:
        """Add the next position straight from a record (``to_logprob_dict``'s), without building its dict."""
        self.start_indices.append(len(self.token_ids))
        if record is not None:
            token, value, rank, top_ids, top_values = record
            self._add(token, value, rank, decode(token))
            for r, (t, v) in enumerate(zip(top_ids, top_values), start=1):
                if t != token:
                    self._add(t, v, r, decode(t))
        self.end_indices.append(len(self.token_ids))

    def _add(self, token: int, logprob: float, rank: int | None, text: str | None) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        self.ranks.append(rank)
        self.decoded_tokens.append(text)

    def __len__(self) -> int:
        return len(self.start_indices)

    def __getitem__(self, index):
        if isinstance(index, slice):
            positions = range(*index.indices(len(self)))
            # Consecutive positions hold consecutive entries: the lists are sliced, not rebuilt position by
            # position (the engine copies a request's logprobs into every output it hands out, each stream step).
            if positions.step == 1:
                lo = self.start_indices[positions.start] if positions else 0
                hi = self.end_indices[positions.stop - 1] if positions else 0
                return FlatLogprobs([i - lo for i in self.start_indices[positions.start:positions.stop]],
                                    [i - lo for i in self.end_indices[positions.start:positions.stop]],
                                    self.token_ids[lo:hi], self.logprobs[lo:hi], self.ranks[lo:hi],
                                    self.decoded_tokens[lo:hi])
            out = FlatLogprobs()
            for i in positions:
                out.append(self[i])
            return out
        start, end = self.start_indices[index], self.end_indices[index]
        return {self.token_ids[j]: Logprob(self.logprobs[j], self.ranks[j], self.decoded_tokens[j])
                for j in range(start, end)}

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def __setitem__(self, index, value) -> None:
        raise TypeError("FlatLogprobs is append-only")

    def __delitem__(self, index) -> None:
        raise TypeError("FlatLogprobs is append-only")

    def insert(self, index, value) -> None:
        raise TypeError("FlatLogprobs is append-only")


# Per generated token: {token id: Logprob} holding the sampled token and the top-k.
SampleLogprobs = list[dict[int, Logprob]] | FlatLogprobs
# Per prompt token: None for the first (nothing predicts it), then {token id: Logprob}.
PromptLogprobs = list[dict[int, Logprob] | None] | FlatLogprobs


def to_logprob_dict(record, decode) -> dict[int, Logprob]:
    """{token id: Logprob} of one record (token, value, rank, top ids, top values): the token first, then the
    top-k with ranks 1..k (the token appears once). ``decode(id)`` gives a token's text, or None."""
    token, value, rank, top_ids, top_values = record
    out = {token: Logprob(value, rank, decode(token))}
    for r, (t, v) in enumerate(zip(top_ids, top_values), start=1):
        if t not in out:
            out[t] = Logprob(v, r, decode(t))
    return out


def add_records(built: list | FlatLogprobs, records, decode) -> None:
    """Append the positions of ``records`` (None: the first prompt position) to ``built``, a list of dicts or a
    FlatLogprobs."""
    if isinstance(built, FlatLogprobs):
        for r in records:
            built.append_record(r, decode)
    else:
        built += [None if r is None else to_logprob_dict(r, decode) for r in records]
