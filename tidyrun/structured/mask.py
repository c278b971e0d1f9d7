"""The token mask: a host int32 bitmask per sequence, and its application to the logits on their device.

Bit ``t % 32`` of word ``t // 32`` set = token ``t`` allowed: the layout
llguidance writes.
"""

from __future__ import annotations

import torch

from ..device_copy import to_device
from ..sampling import allowed_tokens


class MaskLayout:
    """How llguidance's mask (one bit per tokenizer token) maps onto the logits' width.

    llguidance is built with ``n_vocab = max(vocab_size, len(tokenizer))``:
    when the logits are wider than the tokenizer the padding tokens have no
    bytes and are never allowed; when the tokenizer is wider (added tokens the
    model cannot produce) the mask is cut to the logits' width (through a
    scratch row when it has more words) and the bits past ``vocab_size`` are
    cleared.
    """

    def __init__(self, vocab_size: int, lib_vocab: int) -> None:
        self.vocab_size = vocab_size
        self.lib_vocab = lib_vocab
        self.words = (vocab_size + 31) // 32
        self.lib_words = (lib_vocab + 31) // 32
        self.cut = lib_vocab > vocab_size

    @property
    def direct(self) -> bool:
        """The library writes straight into a bitmask row (same number of words)."""
        return self.words == self.lib_words

    def check(self, bitmask: torch.Tensor) -> None:
        if (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu"
                or bitmask.shape[1] != self.words or bitmask.stride(1) != 1):
            raise ValueError(f"bitmask must be a CPU int32 tensor [rows, {self.words}] with contiguous rows "
                             f"(new_bitmask builds one); got {bitmask.dtype} {tuple(bitmask.shape)} on "
                             f"{bitmask.device}")

    def check_rows(self, bitmask: torch.Tensor, rows: list[int]) -> None:
        if any(not 0 <= r < bitmask.shape[0] for r in rows) or len(set(rows)) != len(rows):
            raise IndexError(f"bitmask rows must be distinct and below {bitmask.shape[0]}, got {rows}")

    def clear_tail(self, row: torch.Tensor) -> None:
        """Clear the bits of the last word that lie past ``vocab_size`` (tokens a cut mask still has there)."""
        extra = self.words * 32 - self.vocab_size
        if self.cut and extra:
            row[-1] &= (1 << (32 - extra)) - 1


def new_bitmask(rows: int, vocab_size: int, allow_all: bool = True) -> torch.Tensor:
    """A host int32 bitmask [rows, ceil(vocab_size / 32)] with every token allowed (``allow_all=False``:
    uninitialised, for a caller that fills every row, which saves a fill of the whole buffer each step).

    Plain (pageable) memory: ``apply_bitmask``'s copy to the device has left
    the buffer when it returns, so the host may refill it for the next step.
    """
    if rows < 0 or vocab_size < 1:
        raise ValueError(f"need rows >= 0 and vocab_size >= 1, got {rows}, {vocab_size}")
    shape = (rows, (vocab_size + 31) // 32)
    return torch.full(shape, -1, dtype=torch.int32) if allow_all else torch.empty(shape, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set the logits of disallowed tokens to -inf, in place, on the logits' device.

    ``logits`` [N, vocab] float; ``bitmask`` int32 [R, ceil(vocab/32)] on the
    host or already on the logits' device (``StepInputs.send_mask``). Bitmask row i applies to logits row ``rows[i]`` (all N rows, R == N,
    when ``rows`` is None). One copy of the mask to the device, then
    ``sampling.allowed_tokens``' vectorized unpacking (one byte per token).
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"need logits [N, vocab] and an int32 bitmask [R, words]; got {tuple(logits.shape)} "
                         f"and {bitmask.dtype} {tuple(bitmask.shape)}")
    n_rows, vocab = logits.shape
    words = (vocab + 31) // 32
    if bitmask.shape[1] != words:
        raise ValueError(f"bitmask has {bitmask.shape[1]} words per row; logits of width {vocab} need {words}")
    if rows is not None:
        rows = [int(r) for r in rows]
        if any(not 0 <= r < n_rows for r in rows) or len(set(rows)) != len(rows):
            raise ValueError(f"rows must be distinct logits rows below {n_rows}, got {rows}")
    count = n_rows if rows is None else len(rows)
    if bitmask.shape[0] != count:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows for {count} logits rows")
    if count == 0:
        return
    dev = logits.device
    refused = ~allowed_tokens(bitmask.to(dev), vocab)
    if rows is None:
        logits.masked_fill_(refused, float("-inf"))
        return
    index = to_device(rows, dev, torch.long)
    logits[index] = logits[index].masked_fill(refused, float("-inf"))
