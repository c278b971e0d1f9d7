"""Flattened model inputs and attention metadata for one scheduled batch.

Two builders share one host-side pass over the sequences (``host_batch``,
whose plain-list result is also what a tensor-parallel driver sends its
workers):

- ``build_reference_batch`` makes the padded gather maps of the torch
  reference attention (CPU), one small tensor each;
- ``StepInputs`` (CUDA, Triton kernels) packs every integer input of a step
  into one pinned host buffer and sends it in a single copy into one device
  buffer whose slices are the step's tensors. A batch that a CUDA graph will
  replay (decode, or decode with up to k drafts per sequence) is written at
  the fixed offsets that graph captured, padded to its size: padding tokens
  (slot -1) sit after the last sequence's, padding sequences own no token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from ..attention import AttentionMetadata
from ..attention.metadata import list_tiles, tile_shape, tile_splits
from ..resources import ResourceLedger, pinned_host_buffer, unpin_host_buffer
from ..scheduler import ScheduledBatch
from ..sequence import Sequence


@dataclass
class InputBatch:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    metadata: AttentionMetadata | None  # None for a graph step: the graph replays the metadata it captured
    logits_indices: torch.Tensor | None  # flat rows whose logits are needed: 1 per sampling sequence, 1 + drafts
    # if speculating; None for a graph step, where every real row is needed (rows [0, num_rows))
    graph: tuple[int, int] | None = None  # (sequences, tokens per sequence) of the CUDA graph to replay
    num_rows: int = 0  # real (unpadded) token rows of a graph step


@dataclass
class HostBatch:
    """A step's model inputs as plain integer lists: all any rank needs to run the forward.

    Holds no Sequence (no generator, no tokenizer), so the tensor-parallel
    driver sends it to the workers as it is.
    """

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    query_start: list[int]
    seq_lens: list[int]
    logits_indices: list[int]
    query_lens: list[int]
    tables: list[list[int]]


class PromptRows(NamedTuple):
    """Logits rows a prefill chunk adds for ``prompt_logprobs``: those of prompt tokens ``first`` ..
    ``first + count - 1`` (each predicted by the row of the token before it)."""

    seq: Sequence
    first: int
    count: int


def host_batch(batch: ScheduledBatch, block_size: int) -> tuple[HostBatch, list[Sequence], list[PromptRows]]:
    """The step's inputs, the sequences whose step ends at their last (or last draft) token, and the
    prompt rows of sequences that asked for prompt logprobs.

    ``logits_indices`` lists the sampling rows first (one per sampling sequence, plus its drafts), then
    the prompt rows in ``PromptRows`` order.
    """
    h = HostBatch([], [], [], [0], [], [], list(batch.num_new_tokens), [s.block_table for s in batch.seqs])
    sampling_seqs: list[Sequence] = []
    prompt_rows: list[PromptRows] = []
    prompt_indices: list[int] = []
    end = 0
    # The decode case runs once per sequence per step (256 a step at batch 256): bound methods, no slices.
    ids, positions, slots, query_start = h.input_ids.append, h.positions.append, h.slots.append, h.query_start.append
    seq_lens, logits_index, sampling = h.seq_lens.append, h.logits_indices.append, sampling_seqs.append
    for seq, n in zip(batch.seqs, batch.num_new_tokens):
        start = seq.num_computed_tokens
        drafts = seq.draft_tokens
        table = seq.block_table
        token_ids = seq.token_ids
        end += n
        if n == 1 and not drafts:
            # A pending token (async scheduling) is not on the host yet: -1 - r stands for row r of the
            # tokens of the step still running, which the runner puts in place on the device.
            ids(token_ids[start] if start < len(token_ids) else -1 - seq.pending_row)
            positions(start)
            block, offset = divmod(start, block_size)
            slots(table[block] * block_size + offset)
            query_start(end)
            seq_lens(start + 1)
            if start + 1 == len(token_ids) + seq.num_pending:
                logits_index(end - 1)
                sampling(seq)
        else:
            h.input_ids.extend((token_ids + drafts)[start:start + n] if drafts else token_ids[start:start + n])
            h.positions.extend(range(start, start + n))
            h.slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(start, start + n))
            query_start(end)
            seq_lens(start + n)
            if start + n == len(token_ids) + seq.num_pending + len(drafts):
                h.logits_indices.extend(range(end - 1 - len(drafts), end))
                sampling(seq)
        if seq.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            prompt_indices.extend(range(end - n, end - n + count))
            prompt_rows.append(PromptRows(seq, start + 1, count))
    h.logits_indices.extend(prompt_indices)
    return h, sampling_seqs, prompt_rows


def build_reference_batch(h: HostBatch, device: torch.device) -> InputBatch:
    """Inputs for the torch reference attention: flat tensors plus padded gather maps."""
    num_seqs = len(h.seq_lens)
    max_q = max(h.query_lens)
    block_tables = torch.zeros(num_seqs, max(len(t) for t in h.tables), dtype=torch.int32)
    q_index = torch.zeros(num_seqs, max_q, dtype=torch.int64)
    q_valid = torch.zeros(num_seqs, max_q, dtype=torch.bool)
    q_positions = torch.zeros(num_seqs, max_q, dtype=torch.int64)
    for b, (table, n, total) in enumerate(zip(h.tables, h.query_lens, h.seq_lens)):
        block_tables[b, : len(table)] = torch.tensor(table, dtype=torch.int32)
        q_index[b, :n] = torch.arange(h.query_start[b], h.query_start[b] + n)
        q_valid[b, :n] = True
        q_positions[b, :n] = torch.arange(total - n, total)

    def dev(x, dtype=None) -> torch.Tensor:
        t = x if isinstance(x, torch.Tensor) else torch.tensor(x, dtype=dtype)
        return t.to(device, non_blocking=True)

    meta = AttentionMetadata(
        slot_mapping=dev(h.slots, torch.int64), query_start_loc=dev(h.query_start, torch.int32),
        seq_lens=dev(h.seq_lens, torch.int32), block_tables=dev(block_tables), max_query_len=max_q,
        max_seq_len=max(h.seq_lens), q_index=dev(q_index), q_valid=dev(q_valid), q_positions=dev(q_positions),
    )
    return InputBatch(dev(h.input_ids, torch.int64), dev(h.positions, torch.int64), meta,
                      dev(h.logits_indices, torch.int64))


class HostTokens(NamedTuple):
    """Sampled tokens (and their logprob records: ``records``, None without) being copied into
    ``StepInputs.tokens_host`` (and ``records_host``); ``event`` marks the copy's end (CUDA)."""
    view: torch.Tensor
    records: torch.Tensor | None
    event: torch.cuda.Event | None

    def read(self) -> tuple[list[int], list[list[float]] | None]:
        if self.event is not None:
            self.event.synchronize()
        return self.view.tolist(), None if self.records is None else self.records.tolist()


class StepInputs:
    """The staging buffers every Triton-path step's integer inputs travel through, in one copy.

    Owns device memory: one int64 buffer (ledger owner ``inputs``), and a
    pinned host buffer of the same size (``release`` unpins it), plus a
    pinned one for two steps' sampled tokens and one for their logprob
    records, on their way back (async scheduling: ``send_tokens``), and one
    for a step's grammar bitmask on its way out (``send_mask``). CUDA graphs capture views of the
    device buffer (``graph_views``), so it must outlive them (it is
    acquired before them and released after them). The pinned host buffer
    is tracked as ``inputs_host``. Also the split kernels' arrival counters
    (``counters``, int32, zero between kernels), which every step's metadata
    carries and graphs capture.
    """

    NUM_COUNTERS = 4096  # output tiles (16 rows x block_n) of a split few-row product; <= 8 x 2 x SMs in use

    def __init__(self, block_size: int, group: int, num_kv_heads: int, max_tokens: int, max_seqs: int,
                 max_blocks: int, device: torch.device, ledger: ResourceLedger,
                 batch_invariant: bool = False, mask_words: int = 0) -> None:
        self.block_size, self.group, self.max_blocks = block_size, group, max_blocks
        self.num_kv_heads = num_kv_heads
        self.batch_invariant = batch_invariant  # see attention_tiles
        self.device = device
        # Eager layout: 4 token arrays (ids, positions, slots, logits indices), query starts, lengths,
        # 2 tile arrays (at most one tile per token), block tables. Graph layouts are smaller.
        capacity = 6 * max_tokens + 2 * max_seqs + 1 + max_seqs * max_blocks
        self.device_buf = ledger.track("inputs", "inputs.device", torch.zeros(capacity, dtype=torch.int64, device=device))
        host = (pinned_host_buffer(capacity, torch.int64) if device.type == "cuda"
                else torch.zeros(capacity, dtype=torch.int64))
        self.host_buf = ledger.track("inputs_host", "inputs.host", host)
        self._host = self.host_buf.numpy()
        self.counters = ledger.track("inputs", "inputs.counters",
                                     torch.zeros(self.NUM_COUNTERS, dtype=torch.int32, device=device))
        self._copied = torch.cuda.Event() if device.type == "cuda" else None
        # Two slots of sampled tokens: the step being booked and the one launched after it.
        self.max_seqs = max_seqs
        tokens = (pinned_host_buffer(2 * max_seqs, torch.int64) if device.type == "cuda"
                  else torch.zeros(2 * max_seqs, dtype=torch.int64))
        self.tokens_host = ledger.track("inputs_host", "inputs.tokens_host", tokens)
        records = (pinned_host_buffer(2 * max_seqs * 3, torch.float64) if device.type == "cuda"
                   else torch.zeros(2 * max_seqs * 3, dtype=torch.float64))
        self.records_host = ledger.track("inputs_host", "inputs.records_host", records)  # (token, logprob, rank)
        self._token_copies = [torch.cuda.Event(), torch.cuda.Event()] if device.type == "cuda" else None
        self._token_slot = 0
        # One step's grammar bitmask (``send_mask``), CUDA only: int32 [max_seqs, mask_words].
        self.mask_words = mask_words
        self.masks_host = (ledger.track("inputs_host", "inputs.masks_host",
                                        pinned_host_buffer(max_seqs * mask_words, torch.int32))
                           if device.type == "cuda" and mask_words else None)
        self._mask_copied = torch.cuda.Event() if self.masks_host is not None else None
        self._views: dict[tuple[int, int], dict[str, torch.Tensor]] = {}

    @staticmethod
    def _graph_offsets(size: int, q: int) -> dict[str, int]:
        """Where each input of the graph of ``size`` sequences x ``q`` tokens starts (block tables last)."""
        t = size * q
        return dict(input_ids=0, positions=t, slot_mapping=2 * t, query_start_loc=3 * t, seq_lens=3 * t + size + 1,
                    block_tables=3 * t + 2 * size + 1)

    def graph_views(self, size: int, q: int) -> dict[str, torch.Tensor]:
        """Views of the device buffer that the CUDA graph of ``size`` sequences x ``q`` tokens reads
        (made once per graph: slicing six views costs a decode step ~10 us of host time)."""
        if (size, q) not in self._views:
            self._views[(size, q)] = self._make_graph_views(size, q)
        return self._views[(size, q)]

    def _make_graph_views(self, size: int, q: int) -> dict[str, torch.Tensor]:
        t, at, buf = size * q, self._graph_offsets(size, q), self.device_buf
        lengths = dict(input_ids=t, positions=t, slot_mapping=t, query_start_loc=size + 1, seq_lens=size,
                       block_tables=size * self.max_blocks)
        views = {name: buf[at[name]:at[name] + n] for name, n in lengths.items()}
        views["block_tables"] = views["block_tables"].view(size, self.max_blocks)
        return views

    def _write(self, chunks: list[tuple[int, list[int]]], tables: tuple[int, int, list[list[int]]]) -> None:
        """Fill the staging buffer and send it in one copy. ``tables``: (offset, row width, rows);
        each row is written from its start, entries past a row's length are never read."""
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy must have left the staging buffer
        host = self._host
        for offset, values in chunks:
            host[offset:offset + len(values)] = values
        offset, width, rows = tables
        for b, row in enumerate(rows):
            start = offset + b * width
            host[start:start + len(row)] = row
        end = max([offset + width * len(rows)] + [o + len(v) for o, v in chunks])
        self.device_buf[:end].copy_(self.host_buf[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def send_tokens(self, tokens: torch.Tensor, records: torch.Tensor | None = None) -> "HostTokens":
        """Start copying a step's sampled tokens (and float64 logprob records [rows, 3], if any) to the host
        without waiting for the step (the next one is launched first); ``HostTokens.read`` waits for this
        copy only, not for later work on the stream."""
        slot, self._token_slot = self._token_slot, self._token_slot ^ 1
        view = self.tokens_host[slot * self.max_seqs:slot * self.max_seqs + tokens.numel()]
        rows = None
        if records is not None:
            start = slot * self.max_seqs * 3
            rows = self.records_host[start:start + records.numel()].view(-1, 3)
        event = None if self._token_copies is None else self._token_copies[slot]
        if event is not None:
            event.synchronize()  # the slot's copy of two steps ago was read before this step was launched
        view.copy_(tokens, non_blocking=event is not None)
        if rows is not None:
            rows.copy_(records, non_blocking=event is not None)
        if event is not None:
            event.record()
        return HostTokens(view, rows, event)

    def send_mask(self, bitmask: torch.Tensor) -> torch.Tensor:
        """A step's grammar bitmask (host int32 [rows, words]) on the device, through the pinned staging buffer
        without waiting. Why: torch copies pageable memory to the device synchronously, after everything
        queued on the stream, that is after the forward pass launched just before; on the H100 host that
        left a 64-row JSON step's host waiting for the device every step."""
        rows, words = bitmask.shape
        if self.masks_host is None or words != self.mask_words or rows > self.max_seqs:
            return bitmask.to(self.device)
        self._mask_copied.synchronize()  # the last mask has left the staging buffer (long since, in practice)
        stage = self.masks_host[:rows * words].view(rows, words)
        # numpy's copy, on this thread only: torch's CPU copy of a mask this size wakes its OpenMP threads,
        # which then spin and starve llguidance's pool filling the next masks (H100 host, 64 JSON rows:
        # the mask wait went from 0.2 to 2.2 ms a step with stage.copy_; 0.14 ms with OMP_NUM_THREADS=1).
        np.copyto(stage.numpy(), bitmask.numpy(), casting="no")  # int32 words, never narrowed
        out = stage.to(self.device, non_blocking=True)
        self._mask_copied.record()
        return out

    def release(self) -> None:
        """Unpin the host buffers (their pages go back to the OS once the last view of them dies)."""
        for buf in (self.host_buf, self.tokens_host, self.records_host, self.masks_host):
            if buf is None:
                continue
            if buf.is_pinned():
                unpin_host_buffer(buf)

    def attention_tiles(self, num_seqs: int, max_query_len: int) -> tuple[int, int, int]:
        """(BLOCK_Q, BLOCK_M, splits) of the attention kernel for a step of ``num_seqs`` sequences, eager or
        captured; with ``batch_invariant`` the shape a decode row gets is the one a prefill row gets."""
        block_q, block_m = tile_shape(self.group, max_query_len, self.batch_invariant)
        return block_q, block_m, tile_splits(num_seqs, self.num_kv_heads, block_q, self.batch_invariant)

    def build(self, h: HostBatch, graph: tuple[int, int] | None = None) -> InputBatch:
        if graph is not None:
            return self._build_graph_step(h, *graph)
        seqs = len(h.seq_lens)
        block_q, block_m, splits = self.attention_tiles(seqs, max(h.query_lens))
        tile_seq, tile_q0 = list_tiles(h.query_lens, block_q)
        width = max(len(t) for t in h.tables)
        arrays = [h.input_ids, h.positions, h.slots, h.logits_indices, h.query_start, h.seq_lens, tile_seq, tile_q0]
        offsets = np.cumsum([0] + [len(a) for a in arrays] + [seqs * width]).tolist()
        self._write(list(zip(offsets, arrays)), (offsets[8], width, h.tables))
        v = [self.device_buf[offsets[i]:offsets[i + 1]] for i in range(9)]
        meta = AttentionMetadata(slot_mapping=v[2], query_start_loc=v[4], seq_lens=v[5],
                                 block_tables=v[8].view(seqs, width), max_query_len=max(h.query_lens),
                                 max_seq_len=max(h.seq_lens), tile_seq=v[6], tile_q0=v[7],
                                 block_q=block_q, block_m=block_m, splits=splits, counters=self.counters)
        return InputBatch(v[0], v[1], meta, v[3])

    def _build_graph_step(self, h: HostBatch, size: int, q: int) -> InputBatch:
        rows, at = len(h.input_ids), self._graph_offsets(size, q)
        pad, pad_seqs = size * q - rows, size - len(h.seq_lens)
        self._write([(at["input_ids"], h.input_ids + [0] * pad), (at["positions"], h.positions + [0] * pad),
                     (at["slot_mapping"], h.slots + [-1] * pad),
                     (at["query_start_loc"], h.query_start + [rows] * pad_seqs),
                     (at["seq_lens"], h.seq_lens + [0] * pad_seqs)],
                    (at["block_tables"], self.max_blocks, h.tables))
        views = self.graph_views(size, q)
        return InputBatch(views["input_ids"], views["positions"], None, None, graph=(size, q), num_rows=rows)
