"""Continuous batching over a paged KV cache.

Each step first advances every running sequence (one decode token, or the
next chunk of a prefill), then admits waiting sequences while the token
budget, the sequence limit and free KV blocks allow. When a running sequence
needs a block and none is free, the most recently admitted running sequence
is preempted: its blocks are freed and it is recomputed later from its
tokens, which costs compute but never changes its output.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .kv_cache import BlockPool
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many new tokens each computes."""

    seqs: list[Sequence]
    num_new_tokens: list[int]

    def __len__(self) -> int:
        return len(self.seqs)


class Scheduler:
    def __init__(self, block_pool: BlockPool, block_size: int, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = block_pool
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

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

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        seqs: list[Sequence] = []
        counts: list[int] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_needed(seq, n)
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
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            need = self._blocks_needed(seq, n)
            if need > self.pool.num_free:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.block_table.extend(self.pool.allocate(need))
            self.running.append(seq)
            seqs.append(seq)
            counts.append(n)
            budget -= n
        return ScheduledBatch(seqs, counts)

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
