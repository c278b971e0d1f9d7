"""One generated sequence: its tokens, KV blocks, detokenized text and stop state."""

from __future__ import annotations

import enum
from collections.abc import Collection
from typing import NamedTuple

import torch

from . import kv_cache
from .kv_cache import BlockKey
from .sampling import unfiltered
from .sampling_params import SamplingParams
from .tokenizer import IncrementalDetokenizer, Tokenizer


def streamable_length(text: str, stop: tuple[str, ...], finished: bool) -> int:
    """How much of ``text`` may be streamed now: while running, hold back what could
    still turn out to be the start of a stop string (it would be cut from the output)."""
    if finished or not stop:
        return len(text)
    return max(0, len(text) - (max(len(s) for s in stop) - 1))


# One token's logprob record, as the runner computed it: (token id, value, 1-based rank, top-k ids,
# top-k values). Kept as plain numbers until an output is built (see logprobs.to_logprob_dicts), and
# as tuples only: CPython stops tracking a tuple of numbers at its first collection, while a list stays
# tracked forever. A rollout holds one record per token per row (256 rows x thousands of steps), and
# with lists inside them every full collection walked all of them: a batch-256 step's median host time
# went from 120 us to 274 us (mean 115 us to 1012 us) in a CPU micro-benchmark.
TokenLogprob = tuple[int, float, int, tuple[int, ...], tuple[float, ...]]
NO_TOP: tuple = ()  # the top-k of a ``logprobs=0`` record


class SampledTokens(NamedTuple):
    """What one step produced for one sequence: its new tokens and, if it asked, their logprob records."""

    seq: "Sequence"
    tokens: list[int]
    logprobs: list[TokenLogprob] | None = None


class PromptLogprobRecords(NamedTuple):
    """Logprob records of prompt tokens ``first``, ``first + 1``, ... of one sequence, from one step."""

    seq: "Sequence"
    first: int
    records: list[TokenLogprob]


class StepOutput(NamedTuple):
    """What the runner returns for one step, for the scheduler to book."""

    sampled: list[SampledTokens]
    prompt_logprobs: list[PromptLogprobRecords]


def launchable(seq: "Sequence", raw_logprobs: bool) -> bool:
    """Whether a step can draw this sequence's token (and its ``logprobs=0`` record) from the logits alone,
    so the host need not see them before the next step is launched (async scheduling): no logits
    processing (penalties, bias, grammar), drafts, prompt logprobs, or stop-token ban below ``min_tokens``;
    logprobs only of the one-pass kind (``one_pass``, in ``raw_logprobs`` mode: the RL rollout's), and a
    step takes those only if all its sequences are one-pass (``StepPipeline``, ``ModelRunner.launch``)."""
    if (seq.grammar is not None or seq.draft_tokens or seq.prompt_logprobs is not None
            or (seq.params.min_tokens and seq.below_min_tokens())):
        return False
    return not seq.needs_processing or (raw_logprobs and seq.one_pass)


def deferrable(seq: "Sequence") -> bool:
    """Whether a step's forward pass can be launched for this sequence before the step before it is booked,
    its sampling following once it is (async scheduling, ``ModelRunner.launch(defer=True)``): what processing
    needs from the host (grammar masks, penalties, bans, ``min_tokens``) is there by then. Not drafts (their
    proposals need the tokens), prompt logprobs, or top-k logprobs (records wider than one token's)."""
    return not seq.draft_tokens and seq.prompt_logprobs is None and seq.params.logprobs in (None, 0)


def draw_steps(seqs: list["Sequence"], launched: bool = False) -> list[int]:
    """Each sequence's step in the key of its race noise (``Sampler``, keyed): the output index of the token
    its step samples, whatever the scheduling: tokens on the host plus those of steps still running, minus
    the step's own when its launch is already booked (``launched``: ``ModelRunner.sample_launched``). A
    request's seeded draws then depend only on its seed and this index, not on the batch or on async
    scheduling."""
    return [len(s.token_ids) + s.num_pending - s.num_prompt_tokens - launched for s in seqs]


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Looking a member up on its Enum class costs ~0.3 us on Python 3.11 (a plain name, 0.02 us), and
# ``is_finished`` runs several times per sequence per step: ~0.3 ms of a batch-256 step's host time.
_FINISHED = SequenceStatus.FINISHED


class Sequence:
    """Prompt + output token ids of one sample of a request, and where its KV lives.

    ``num_computed_tokens`` counts tokens whose KV is in the cache; after a
    preemption it drops to 0 and the sequence is recomputed from its tokens.
    """

    def __init__(self, seq_id: int, request_id: str, index: int, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer, generator: torch.Generator | None,
                 grammar=None) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.index = index
        self.params = params
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens the prefix cache served when it was last admitted
        self.block_table: list[int] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator = generator
        self._text = ""
        self._decoded = len(self.token_ids)  # tokens already given to the detokenizer (see ``text``)
        self._text_final = False
        self.num_registered_blocks = 0  # leading blocks already offered to the prefix cache
        self.draft_tokens: list[int] = []  # speculative tokens scheduled for this step (verified, then cleared)
        # Async scheduling (engine.StepPipeline): a token sampled by a step still running on the device is
        # "pending": it counts in ``num_tokens`` (the next step computes it) but is not in ``token_ids`` until
        # its step is booked; the next step's input for it is row ``pending_row`` of that step's tokens.
        self.num_pending = 0
        self.pending_row = 0
        self._block_keys: list[BlockKey] = []
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        # Logprobs, when asked: one record per output token, their running sum, and one per prompt token
        # (index i: token i given tokens < i; index 0 stays None). Prompt records are written by position,
        # so recomputing a prompt after a preemption writes the same entries again.
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] * len(prompt_token_ids) if params.prompt_logprobs is not None else None)
        self.grammar = grammar  # structured outputs: where this sequence is in its grammar (host state)
        # Whether its logits need more than temperature/top-k/top-p/min-p and a min_tokens stop-token ban
        # (penalties, bias, masks, structured outputs) or logprobs: such sequences never speculate and take
        # the runner's general sampling path. Decided once: the runner checks it for every sequence every step.
        self.needs_processing = params.processes_logits or params.logprobs is not None
        # Whether its token and ``logprobs=0`` record can come from one pass over the logits (the runner's
        # RL-rollout path): greedy or sampled from the whole distribution, nothing else processed. Decided
        # once for the same reason (at batch 256 the per-step checks of the params cost ~0.5 ms on the H200).
        self.greedy = params.greedy
        self._max_output = params.max_tokens if params.max_tokens is not None else float("inf")
        whole = params.logprobs in (None, 0) and (self.greedy or unfiltered(params))
        self.one_pass = whole and not params.processes_logits
        # The same for a structured sequence whose grammar's mask is its only processing (no penalties, bias,
        # bans, allowed ids or ignore_eos): one race that reads the mask picks its token (``ModelRunner``).
        self.masked_one_pass = (whole and grammar is not None and not params.ignore_eos
                                and not params.processes_besides_grammar)

    @property
    def text(self) -> str:
        """The output text so far.

        Without stop strings nothing needs the text while generating, so
        tokens are detokenized when someone reads it (a stream, the final
        output), several at a time: per-token detokenization was the largest
        host cost of a large decode batch. For byte-level BPE vocabularies
        decoding tokens together gives the same text as one by one.
        Empty when the request asked for ``detokenize=False``.
        """
        if not self._text_final and self.params.detokenize:
            self._catch_up(len(self.token_ids))
        return self._text

    def _catch_up(self, end: int) -> str:
        """Detokenize tokens up to index ``end``; returns the new text."""
        delta = ""
        if self._decoded < end:
            delta = self._detok.push(self.token_ids[self._decoded:end])
            self._decoded = end
            self._text += delta
        return delta

    def _final_text(self, end: int) -> None:
        """Text of the tokens before ``end`` plus whatever the detokenizer still holds back."""
        if not self.params.detokenize:
            return
        self._catch_up(end)
        self._text += self._detok.flush()
        self._text_final = True

    @property
    def num_tokens(self) -> int:
        """Tokens known on the host plus the one a step still running sampled (``num_pending``)."""
        return len(self.token_ids) + self.num_pending

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED

    def block_keys(self, block_size: int, num_blocks: int) -> list[BlockKey]:
        """Prefix-cache keys of the first ``num_blocks`` full blocks: block i's digest covers tokens
        [0, (i+1)*bs) (computed once per block)."""
        while len(self._block_keys) < num_blocks:
            i = len(self._block_keys)
            parent = self._block_keys[-1].digest if i else b""
            tokens = tuple(self.token_ids[i * block_size:(i + 1) * block_size])
            self._block_keys.append(BlockKey(kv_cache.prefix_digest(parent, tokens), parent, tokens))
        return self._block_keys[:num_blocks]

    def below_min_tokens(self) -> bool:
        return self.num_output_tokens < self.params.min_tokens

    def finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.status = SequenceStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def record_prompt_logprobs(self, first: int, records: list[TokenLogprob]) -> None:
        """Logprob records of prompt tokens ``first``, ``first + 1``, ... (a prefill chunk's)."""
        self.prompt_logprobs[first:first + len(records)] = records

    def append_token(self, token_id: int, eos_token_ids: Collection[int], max_model_len: int,
                     logprob: TokenLogprob | None = None) -> None:
        """Add a sampled token and finish the sequence if a stop condition holds. Runs once per sequence
        per step, so the common case (no stop token, no stop string, below the limits) is kept short."""
        token_ids = self.token_ids
        token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob[1]
        if self.grammar is not None:
            if token_id in eos_token_ids:
                self.grammar.accept(token_id)
                if self.grammar.is_terminated:  # the structure is complete
                    self._final_text(len(self.token_ids) - 1)
                    self.finish("stop")
                    return
            else:  # advanced with the next step's masks, all rows together (GrammarState says why)
                self.grammar.accept_later(token_id)
        p = self.params
        num_output = len(token_ids) - self.num_prompt_tokens
        if token_id in eos_token_ids or token_id in p.stop_token_ids:
            if num_output >= p.min_tokens and (token_id in p.stop_token_ids or not p.ignore_eos):
                self._final_text(len(token_ids) - 1)  # the stop token is not part of the text
                self.finish("stop", token_id if token_id in p.stop_token_ids else None)
                return
        if p.stop:  # stop strings need each token's text as it comes
            delta = self._catch_up(len(token_ids))
            if num_output >= p.min_tokens and delta and self._check_stop_strings(len(delta)):
                return
        if num_output >= self._max_output or len(token_ids) >= max_model_len:
            self._final_text(len(token_ids))
            self.finish("length")

    def _check_stop_strings(self, delta_len: int) -> bool:
        longest = max(len(s) for s in self.params.stop)
        search_from = max(0, len(self._text) - delta_len - longest + 1)
        hits = [(self._text.find(s, search_from), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        at, stop = min(hits)
        self._text = self._text[: at + len(stop) if self.params.include_stop_str_in_output else at]
        self._text_final = True
        self.finish("stop", stop)
        return True
