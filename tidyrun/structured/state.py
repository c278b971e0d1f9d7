"""One sequence's place in its grammar (host only)."""

from __future__ import annotations

import llguidance
import torch

from .mask import MaskLayout


class GrammarState:
    """Per generated sequence: where the sequence is in its grammar (an llguidance matcher, host only).

    Not thread-safe: one sequence's state is advanced by one thread at a time.

    Why ``accept_later``: the engine hands each sampled token over without
    advancing the grammar; the advance runs with the next step's masks
    (``GrammarCompiler.fill_ahead`` / ``fill_later`` / ``fill_bitmasks``
    advance all rows together, on llguidance's threads, off the main
    thread), instead of one row at a time in the step's update (on the H200,
    64 JSON rows of the 1.2B shape: 134-135 against 139 us a token, when the
    advance first moved into the next step's fill, docs/BENCHMARKS.md).
    While a fill that took a state's token runs, the state is that fill's:
    the engine touches it again only after waiting for the masks.

    A refused token (one the grammar does not allow) leaves the matcher in
    llguidance's error state: its masks allow only the EOS ids and ``error``
    says why.
    """

    def __init__(self, matcher: llguidance.LLMatcher, layout: MaskLayout, compiler) -> None:
        self.matcher = matcher
        self._layout = layout
        self.compiler = compiler  # fills the masks of a whole step at once (``GrammarCompiler.fill_bitmasks``)
        self._pending: int | None = None
        self.version = 0  # tokens handed over so far: a mask filled ahead is current while it is unchanged

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id`` now; False if the grammar did not allow it (the state then allows only EOS).
        A negative id is no token: False, and the state is unchanged."""
        self.flush()
        token_id = int(token_id)
        if token_id < 0:
            return False
        self.version += 1
        return self.matcher.consume_token(token_id)

    def accept_later(self, token_id: int) -> None:
        """Hand over a sampled token; the grammar advances past it before its next mask or query."""
        token_id = int(token_id)
        if token_id < 0:
            raise ValueError(f"a sampled token id cannot be negative, got {token_id}")
        self.flush()
        self._pending = token_id
        self.version += 1

    def flush(self) -> None:
        """Advance past a token handed over with ``accept_later``, if one waits."""
        if self._pending is not None:
            token, self._pending = self._pending, None
            self.matcher.consume_token(token)

    def take_pending(self) -> int | None:
        """The waiting token, now the caller's to advance (``GrammarCompiler.fill_bitmasks`` batches them)."""
        token, self._pending = self._pending, None
        return token

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed at the next step into ``bitmask[row]`` (int32 [rows, ceil(vocab/32)], CPU).

        When the grammar is complete only the model's EOS ids are allowed, so
        the sequence stops; after a refused token the same.
        """
        self._layout.check(bitmask)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        self.flush()
        self.fill_unchecked(bitmask, row)

    def fill_unchecked(self, bitmask: torch.Tensor, row: int) -> None:
        """``fill_bitmask`` for a caller that checked the bitmask and advanced the state."""
        target = bitmask[row]
        if self._layout.direct:
            self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), self._layout.words * 4)
        else:
            wide = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)
            target.copy_(wide[:self._layout.words])
        self._layout.clear_tail(target)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or the state refused a token): only EOS is allowed."""
        self.flush()
        return self.matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the state refused a token, or None while every accepted token was allowed."""
        self.flush()
        return self.matcher.get_error() or None
