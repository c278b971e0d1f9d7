"""Continuous batching over a paged KV cache.

Each step first advances every running sequence (one decode token, or the
next chunk of a prefill), then admits waiting sequences while the token
budget, the sequence limit and free KV blocks allow; an admitted sequence
starts after the longest prefix of its tokens found in the prefix cache. When a running sequence
needs a block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it is recomputed later from its
tokens, which costs compute but never changes its output.

After the runner executed a step, ``update_from_output`` books its result:
sampled tokens appended, computed-token counts advanced, finished sequences
freed, speculation counted, newly full blocks offered to the prefix cache.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass

from .kv_cache import BlockPool
from .sequence import Sequence, SequenceStatus, StepOutput


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many new tokens each computes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int,
                 propose: Callable[[Sequence, int], list[int]] | None = None):
        """``propose(seq, limit)`` returns up to ``limit`` draft tokens for a decoding sequence (speculation)."""
        self.pool = block_pool
        self.propose = propose
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_prefix_cached_tokens = 0  # prompt tokens served from the prefix cache
        self.num_prefill_tokens = 0
        self.num_spec_draft_tokens = 0  # draft tokens verified
        self.num_spec_accepted_tokens = 0  # of which the target model accepted

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        total = -(-(seq.num_computed_tokens + n) // self.block_size)
        return max(0, total - len(seq.block_table))

    def _release(self, seq: Sequence) -> None:
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_registered_blocks = 0

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks for the start of a sequence that holds no blocks yet.

        At least the last token is always recomputed: its logits are needed. A request that asked for
        prompt logprobs computes its whole prompt (cached blocks would skip their logits), as does one that
        asked for ``skip_reading_prefix_cache`` (its blocks are still offered to others).
        """
        if seq.prompt_logprobs is not None or seq.params.skip_reading_prefix_cache:
            return []
        full = (seq.num_tokens - 1) // self.block_size
        return self.pool.lookup(seq.block_keys(self.block_size, full)) if full else []

    def register_computed_blocks(self, seq: Sequence) -> None:
        """Offer blocks that became full and computed in the last step to the prefix cache."""
        full = seq.num_computed_tokens // self.block_size
        if full > seq.num_registered_blocks:
            keys = seq.block_keys(self.block_size, full)
            for i in range(seq.num_registered_blocks, full):
                self.pool.register(seq.block_table[i], keys[i])
            seq.num_registered_blocks = full

    def preempt_running(self) -> None:
        """Preempt every running sequence, keeping their order at the head of the queue (nothing may be in
        flight: each recomputes from its tokens on the host)."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.draft_tokens = []
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        propose, bs = self.propose, self.block_size
        i = 0
        # Once per running sequence per step: the common decode case stays inline (no helper calls).
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            remaining = len(seq.token_ids) + seq.num_pending - seq.num_computed_tokens  # num_tokens, inline
            n = min(remaining, budget)
            if propose is not None:
                seq.draft_tokens = self._drafts(seq, budget) if remaining == 1 else []
                if seq.draft_tokens:
                    extra = len(seq.draft_tokens)
                    if self._blocks_needed(seq, n + extra) <= self.pool.num_free:
                        n += extra
                    else:  # no room to speculate: decode one token rather than preempt someone
                        seq.draft_tokens = []
            need = -(-(seq.num_computed_tokens + n) // bs) - len(seq.block_table)  # _blocks_needed
            if need > 0:  # most decode steps need no new block
                while need > self.pool.num_free and len(self.running) - 1 > i:
                    self._preempt(self.running.pop())
                    preempted = True
                if need > self.pool.num_free:
                    self._preempt(self.running.pop(i))
                    preempted = True
                    continue
                seq.block_table.extend(self.pool.allocate(need))
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            start = len(cached) * self.block_size
            n = min(seq.num_tokens - start, budget)
            need = -(-(start + n) // self.block_size) - len(cached)
            if need + self.pool.num_unreferenced(cached) > self.pool.num_free:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.pool.share(cached)
            seq.block_table = cached + self.pool.allocate(need)
            seq.num_registered_blocks = len(cached)
            seq.num_computed_tokens = seq.num_cached_tokens = start
            self.num_prefix_cached_tokens += start
            self.num_prefill_tokens += seq.num_tokens
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

    def _drafts(self, seq: Sequence, budget: int) -> list[int]:
        # Logprobs and logits processing are per sampled token: such sequences decode one token a step.
        if seq.below_min_tokens() or seq.needs_processing:
            return []
        p = seq.params
        limit = budget - 1
        if p.max_tokens is not None:
            limit = min(limit, p.max_tokens - seq.num_output_tokens - 1)
        return self.propose(seq, limit)

    def update_from_output(self, batch: ScheduledBatch, output: StepOutput,
                           eos_token_ids: Collection[int], max_model_len: int) -> set[str]:
        """Book an executed step; returns the ids of requests with a sequence that finished in it.

        ``output.sampled`` holds the runner's new tokens (and logprob records)
        for sequences whose step reached their end: one token, or a
        speculating sequence's accepted drafts plus one. A chunk of a prefill
        samples nothing; it only advances (and may bring prompt logprobs).
        """
        self.book_launch(batch)
        return self.book_output(batch, output, eos_token_ids, max_model_len)

    def book_launch(self, batch: ScheduledBatch, pending: list[Sequence] | None = None) -> None:
        """The first half of booking, done when the step is launched: computed-token counts advance.
        ``pending``: the step's sampling sequences when their tokens stay on the device for now (async
        scheduling): each holds one pending token, row i of the step's tokens for ``pending[i]``."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n - len(seq.draft_tokens)  # drafts count once verified
        for row, seq in enumerate(pending or ()):
            seq.num_pending += 1
            seq.pending_row = row

    def book_output(self, batch: ScheduledBatch, output: StepOutput, eos_token_ids: Collection[int],
                    max_model_len: int) -> set[str]:
        """The second half: the step's tokens appended, stops checked, finished sequences freed. A sequence
        that finished (or was aborted) while this step ran (async scheduling) gets nothing more."""
        for seq, first, records in output.prompt_logprobs:
            seq.record_prompt_logprobs(first, records)
        finished: set[str] = set()
        for seq, tokens, logprobs in output.sampled:
            if seq.num_pending:
                seq.num_pending -= 1
            if seq.is_finished:
                continue
            # One token, once per sequence per step, without the loop: bench/host_step.py, batch 256, 1.04 ms a
            # step against 1.18 ms with the loop alone (12-05).
            if len(tokens) == 1:
                seq.append_token(tokens[0], eos_token_ids, max_model_len, None if logprobs is None else logprobs[0])
            else:
                for i, token in enumerate(tokens):
                    seq.append_token(token, eos_token_ids, max_model_len, None if logprobs is None else logprobs[i])
                    if seq.is_finished:
                        break
            if seq.draft_tokens:
                accepted = len(tokens) - 1  # their keys/values, written this step, are now valid
                self.num_spec_draft_tokens += len(seq.draft_tokens)
                self.num_spec_accepted_tokens += accepted
                seq.num_computed_tokens = min(seq.num_computed_tokens + accepted, seq.num_tokens - 1)
            if seq.is_finished:
                # Its computed blocks stay reusable after it frees them: a prompt that finishes in the step
                # that computed it (max_tokens=1, scoring) still warms the prefix cache for the next request.
                self.register_computed_blocks(seq)
                self.finish(seq)
                finished.add(seq.request_id)
        bs = self.block_size
        for seq in batch.seqs:
            if seq.draft_tokens:
                seq.draft_tokens = []
            if seq.num_computed_tokens // bs > seq.num_registered_blocks and not seq.is_finished:
                self.register_computed_blocks(seq)  # a block became full (the check repeated: saves a call)
        return finished

    def finish(self, seq: Sequence) -> None:
        """Take a finished sequence out of the running set and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Finish every sequence of ``request_id`` with reason "abort"; returns them."""
        aborted = [s for s in list(self.running) + list(self.waiting) if s.request_id == request_id]
        for seq in aborted:
            self.finish(seq)
            seq.finish("abort")
        return aborted
