"""One sequence's place in its grammar (host only)."""

from __future__ import annotations

import torch

from .mask import MaskLayout


class GrammarState:
    """Per generated sequence: where the sequence is in its grammar (``guidance.GuidanceState`` is the
    library's side).

    Not thread-safe: one sequence's state is advanced by one thread at a time.

    Why ``accept_later``: the engine hands each sampled token over without
    advancing the grammar; the advance runs with the next step's masks
    (``GrammarCompiler.fill_bitmasks`` advances all rows together, on
    llguidance's threads), which the runner computes while the device runs
    that step's forward pass, instead of one row at a time in the step's
    update (on the H200, 64 JSON rows of the 1.2B shape: 134-135 against
    139 us a token before, docs/BENCHMARKS.md).

    A refused token (one the grammar does not allow) leaves the state able
    only to stop: its masks allow only the EOS ids and ``error`` says why.
    """

    def __init__(self, layout: MaskLayout, compiler) -> None:
        self._layout = layout
        self.compiler = compiler  # fills the masks of a whole step at once (``GrammarCompiler.fill_bitmasks``)
        self._pending: int | None = None
        self._refused: str | None = None

    # -- what a backend provides ---------------------------------------------------------

    def _advance(self, token_id: int) -> bool:
        """The library's advance past one token; False if refused."""
        raise NotImplementedError

    def _why_refused(self, token_id: int) -> str:
        raise NotImplementedError

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        """The library's mask for the current state into ``bitmask[row]`` (checked, cut to the logits)."""
        raise NotImplementedError

    def _complete(self) -> bool:
        """The grammar allows nothing but EOS from here (or EOS was accepted)."""
        raise NotImplementedError

    # -- the engine's view ------------------------------------------------------------------

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id`` now; False if the grammar did not allow it (the state then allows only EOS)."""
        self.flush()
        return self._record(int(token_id), self._advance(int(token_id)) if int(token_id) >= 0 else False)

    def accept_later(self, token_id: int) -> None:
        """Hand over a sampled token; the grammar advances past it before its next mask or query."""
        self.flush()
        self._pending = int(token_id)

    def flush(self) -> None:
        """Advance past a token handed over with ``accept_later``, if one waits."""
        if self._pending is not None:
            token, self._pending = self._pending, None
            self._record(token, self._advance(token) if token >= 0 else False)

    def take_pending(self) -> int | None:
        """The waiting token, now the caller's to advance (``GrammarCompiler`` batches them; it calls ``_record``)."""
        token, self._pending = self._pending, None
        return token

    def _record(self, token_id: int, ok: bool) -> bool:
        if not ok and self._refused is None:
            self._refused = self._why_refused(token_id) if token_id >= 0 else f"token id {token_id} is not a token"
        return ok

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed at the next step into ``bitmask[row]`` (int32 [rows, ceil(vocab/32)], CPU).

        When the grammar is complete only the model's EOS ids are allowed, so
        the sequence stops; after a refused token the same.
        """
        self._layout.check(bitmask)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        self.flush()
        if self._refused is not None:
            self._layout.stop_only(bitmask, row)
        else:
            self._fill(bitmask, row)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or the state refused a token): only EOS is allowed."""
        self.flush()
        return self._refused is not None or self._complete()

    @property
    def error(self) -> str | None:
        """Why the state refused a token, or None while every accepted token was allowed."""
        self.flush()
        return self._refused
