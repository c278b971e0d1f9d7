"""Flattened model inputs and attention metadata for one scheduled batch.

Built on the host from the sequences' token lists and block tables, then
copied to the device in one transfer per tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention import AttentionMetadata
from ..scheduler import ScheduledBatch
from ..sequence import Sequence


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # flat indices whose logits are needed: 1 per sampling sequence, 1 + drafts if speculating
    sampling_seqs: list[Sequence]  # the sequences whose step ends at their last (or last draft) token


def build_input_batch(batch: ScheduledBatch, block_size: int, device: torch.device) -> InputBatch:
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sampling_seqs: list[Sequence] = []
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        drafts = seq.draft_tokens
        input_ids.extend((seq.token_ids + drafts)[start:start + n] if drafts else seq.token_ids[start:start + n])
        table = seq.block_table
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_start.append(query_start[-1] + n)
        seq_lens.append(start + n)
        if start + n == seq.num_tokens + len(drafts):
            logits_indices.extend(range(query_start[-1] - 1 - len(drafts), query_start[-1]))
            sampling_seqs.append(seq)

    num_seqs = len(batch.seqs)
    max_q = max(batch.num_new_tokens)
    max_blocks = max(len(s.block_table) for s in batch.seqs)
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    q_index = torch.zeros(num_seqs, max_q, dtype=torch.int64)
    q_valid = torch.zeros(num_seqs, max_q, dtype=torch.bool)
    q_positions = torch.zeros(num_seqs, max_q, dtype=torch.int64)
    for b, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
        block_tables[b, : len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.int32)
        q_index[b, :n] = torch.arange(query_start[b], query_start[b] + n)
        q_valid[b, :n] = True
        q_positions[b, :n] = torch.arange(seq.num_computed_tokens, seq.num_computed_tokens + n)

    def dev(x, dtype=None) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
        return t.to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=dev(slots, torch.int64),
        query_start_loc=dev(query_start, torch.int32),
        seq_lens=dev(seq_lens, torch.int32),
        block_tables=dev(block_tables),
        max_query_len=max_q,
        max_seq_len=max(seq_lens),
        q_index=dev(q_index),
        q_valid=dev(q_valid),
        q_positions=dev(q_positions),
    )
    return InputBatch(dev(input_ids, torch.int64), dev(positions, torch.int64), meta,
                      dev(logits_indices, torch.int64), sampling_seqs)
