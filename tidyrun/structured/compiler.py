"""Per engine: compiles ``StructuredOutputsParams`` into grammars, states, and a step's masks."""

from __future__ import annotations

import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from .guidance import GuidanceBackend, GuidanceGrammar
from .mask import MaskLayout, new_bitmask
from .specs import cache_key
from .state import GrammarState

# Compiled grammars kept per engine; a request with a grammar seen recently skips compilation.
_CACHE_SIZE = 128


class GrammarCompiler:
    """Per engine (no module-level state): compiles ``StructuredOutputsParams`` into grammars and states.

    Built once from the engine's tidyrun Tokenizer and the model's vocab size
    (the logits width, which may exceed ``len(tokenizer)``). llguidance's view
    of the tokenizer (~1 s to build) is built on the first ``compile``:
    engines that never see a structured request never pay for it.
    ``compile`` / ``new_state`` may be called from several threads.

    Owns one host worker thread (``fill_later`` / ``fill_ahead``; started
    on first use, joined by ``close``) and llguidance's pool; no device
    memory.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], threads: int | None = None,
                 lanes: int = 64) -> None:
        """``threads``: llguidance's pool size for ``fill_bitmasks`` (None: 80% of the usable cores, at most
        32). ``lanes``: how many times a grammar is built at most, as sequences need them (see
        ``guidance.GuidanceGrammar``)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        bad = [e for e in self.eos_token_ids if not 0 <= e < self.vocab_size]
        if bad:
            raise ValueError(f"eos token ids {sorted(bad)} are outside the vocabulary (size {self.vocab_size})")
        threads = threads if threads is not None else max(1, min(32, int(0.8 * len(os.sched_getaffinity(0)))))
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self._layout = MaskLayout(self.vocab_size, max(self.vocab_size, len(tokenizer)))
        self._backend = GuidanceBackend(tokenizer.hf_tokenizer, self._layout, self.eos_token_ids, threads, lanes)
        self._cache: OrderedDict[tuple, GuidanceGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self._worker: ThreadPoolExecutor | None = None
        self._ahead: _Fill | None = None  # fill_ahead's fill, until fill_later takes it
        self._closed = False

    # -- compiling ------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> GuidanceGrammar:
        """The compiled grammar of ``spec`` (cached per spec, LRU); InvalidRequestError naming the problem."""
        if not isinstance(spec, StructuredOutputsParams):
            raise InvalidRequestError("structured outputs must be a StructuredOutputsParams")
        spec.validate()
        key = cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._backend.compile(spec)  # outside the lock: a large grammar must not stall other requests
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh state at the start of ``spec``'s grammar, for one sequence."""
        return self.compile(spec).new_state(self)

    # -- a step's masks ---------------------------------------------------------------------

    def fill_bitmasks(self, states: Sequence[GrammarState], bitmask: torch.Tensor,
                      rows: Sequence[int] | None = None) -> None:
        """``states[i].fill_bitmask(bitmask, rows[i])`` for all i (rows default to 0..len-1), on llguidance's
        threads, after advancing every state past its token handed over with ``accept_later`` (all rows
        in one call too).

        Same result as the loop; worth it when many constrained sequences
        share a step (the loop costs ~20-1000 us per sequence on one core).
        """
        self._fill_job(states, bitmask, rows)()

    def _fill_job(self, states: Sequence[GrammarState], bitmask: torch.Tensor,
                  rows: Sequence[int] | None = None) -> Callable[[], None]:
        """``fill_bitmasks`` as a call prepared here (checks, waiting tokens taken, the library's argument
        lists built), so that the thread that runs it needs the GIL only to enter llguidance."""
        self._layout.check(bitmask)
        rows = list(range(len(states))) if rows is None else [int(r) for r in rows]
        if len(rows) != len(states):
            raise ValueError(f"{len(states)} states but {len(rows)} rows")
        self._layout.check_rows(bitmask, rows)
        return self._backend.fill_job(states, [s.take_pending() for s in states], bitmask, rows)

    def fill_later(self, states: Sequence[GrammarState]) -> PendingMasks:
        """The masks of ``states`` (a new bitmask [len(states), words] when awaited), filled on this
        compiler's worker thread: rows of the ``fill_ahead`` fill for the states unchanged since it
        started, the others filled now (after it: one worker, in order).

        Why: a step's masks take longer than the rest of its host work (on
        the H200 host, 64 rows deep inside length-bounded JSON strings: ~1.5
        ms against a ~1.8 ms step), so filling them on the main thread after
        the forward pass is launched lengthens the step by most of that.
        Started earlier, they are computed while the main thread books the
        last step, schedules, launches the forward pass and draws the
        sampler's noise; llguidance releases the GIL while it works. Until
        ``PendingMasks.wait`` returns, the states are the worker's: nothing
        else may touch them.
        """
        states = list(states)
        with self._lock:
            ahead, self._ahead = self._ahead, None
        parts, missing = [], list(range(len(states)))
        if ahead is not None:
            found = [(i, ahead.row_of(state)) for i, state in enumerate(states)]
            reused = [(i, row) for i, row in found if row is not None]
            if reused:
                parts.append((ahead, [row for _, row in reused], [i for i, _ in reused]))
            missing = [i for i, row in found if row is None]
        if missing:
            parts.append((self._submit([states[i] for i in missing]), list(range(len(missing))), missing))
        return PendingMasks(states, parts, self._layout.words)

    def fill_ahead(self, states: Sequence[GrammarState]) -> None:
        """Start the masks of ``states``' next step now, before that step is even scheduled (the engine calls
        this right after a step's tokens are handed over); the next ``fill_later`` takes its rows for the
        states unchanged since. Until then the states are the worker's."""
        fill = self._submit(list(states))
        with self._lock:
            self._ahead = fill

    def drain(self) -> None:
        """Wait until the worker has finished every fill started so far (their states are the caller's again)."""
        with self._lock:
            worker = self._worker
        if worker is not None:
            worker.submit(int).result()

    def _submit(self, states: list[GrammarState]) -> _Fill:
        bitmask = new_bitmask(len(states), self.vocab_size, allow_all=False)  # fill_bitmasks writes every row
        versions = [s.version for s in states]
        with self._lock:
            if self._closed:
                raise RuntimeError("this GrammarCompiler is closed")
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidyrun-grammar-masks")
            future = self._worker.submit(self._fill_job(states, bitmask))
        # Hand the GIL over once, so that the worker enters llguidance (which releases it) now: a waiting
        # thread otherwise gets it only when this one next releases it, up to the 5 ms switch interval while
        # this one runs pure Python (the step's booking and scheduling; measured here: 2 ms median before
        # a job started, 0.1 ms with this).
        time.sleep(0)
        return _Fill(future, bitmask, states, versions, {id(s): row for row, s in enumerate(states)})

    def close(self) -> None:
        """Join the worker thread (after the fills it has); idempotent. ``fill_later`` / ``fill_ahead`` refuse
        after."""
        with self._lock:
            worker, self._worker, self._ahead, self._closed = self._worker, None, None, True
        if worker is not None:
            worker.shutdown(wait=True)


class _Fill(NamedTuple):
    """One fill submitted to the worker: its bitmask, and which state each row is (at which version)."""
    future: Future
    bitmask: torch.Tensor
    states: list[GrammarState]
    versions: list[int]
    rows: dict[int, int]  # id(state) -> row

    def row_of(self, state: GrammarState) -> int | None:
        """The row filled for ``state`` if it has taken no token since, else None."""
        row = self.rows.get(id(state))
        if row is None or self.states[row] is not state or self.versions[row] != state.version:
            return None
        return row


class PendingMasks:
    """A step's masks being filled on the compiler's worker thread (``GrammarCompiler.fill_later``): parts
    (fill, its rows, their rows here)."""

    def __init__(self, states: list[GrammarState], parts: list[tuple[_Fill, list[int], list[int]]],
                 words: int) -> None:
        self.states = states
        self._parts = parts
        self._words = words

    def serve(self, states: Sequence[GrammarState]) -> bool:
        """Whether these are the masks of ``states``, in order (the same objects)."""
        return len(self.states) == len(states) and all(a is b for a, b in zip(self.states, states))

    def wait(self) -> torch.Tensor:
        """The filled bitmask (host int32 [len(states), words]); re-raises what a fill raised."""
        for fill, _, _ in self._parts:
            fill.future.result()
        if len(self._parts) == 1:
            fill, src, dst = self._parts[0]
            if fill.bitmask.shape[0] == len(self.states) and src == dst == list(range(len(self.states))):
                return fill.bitmask  # the fill's rows are this step's, in order
        # numpy's row gather, on this thread only: torch's wakes its OpenMP threads for a mask this size, which
        # spin after it beside llguidance's pool (docs/BENCHMARKS.md: the mask wait grew tenfold on the H100)
        out = np.empty((len(self.states), self._words), dtype=np.int32)
        for fill, src, dst in self._parts:
            out[dst] = fill.bitmask.numpy()[src]
        return torch.from_numpy(out)

    def settle(self) -> None:
        """Wait without raising: the states are the caller's again (cleanup after a failed step)."""
        for fill, _, _ in self._parts:
            fill.future.exception()
