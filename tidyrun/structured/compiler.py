"""Per engine: compiles ``StructuredOutputsParams`` into grammars, states, and a step's masks."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

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

    Owns one host worker thread (``fill_later``; started on first use,
    joined by ``close``) and llguidance's pool; no device memory.
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

    def advance(self, states: Sequence[GrammarState]) -> None:
        """Advance every state past its token handed over with ``accept_later``, all rows together on
        llguidance's threads."""
        waiting = [(s, t) for s in states if (t := s.take_pending()) is not None]
        if waiting:
            self._backend.advance_many([s for s, _ in waiting], [t for _, t in waiting])

    def fill_bitmasks(self, states: Sequence[GrammarState], bitmask: torch.Tensor,
                      rows: Sequence[int] | None = None) -> None:
        """``states[i].fill_bitmask(bitmask, rows[i])`` for all i (rows default to 0..len-1), on llguidance's
        threads, after advancing every state past its waiting token (``advance``).

        Same result as the loop; worth it when many constrained sequences
        share a step (the loop costs ~20-1000 us per sequence on one core).
        """
        self._layout.check(bitmask)
        rows = list(range(len(states))) if rows is None else [int(r) for r in rows]
        if len(rows) != len(states):
            raise ValueError(f"{len(states)} states but {len(rows)} rows")
        self._layout.check_rows(bitmask, rows)
        self.advance(states)
        if states:
            self._backend.fill_many(states, bitmask, rows)

    def fill_later(self, states: Sequence[GrammarState]) -> PendingMasks:
        """Start ``fill_bitmasks`` of a new bitmask [len(states), words] on this compiler's worker thread.

        Why: a step's masks take longer than the rest of its host work (on
        the H200 host, 64 rows deep inside length-bounded JSON strings: ~1.5
        ms against a ~1.8 ms step), so filling them on the main thread after
        the forward pass is launched still lengthens the step. Started
        before the launch, they are computed while the main thread launches
        the forward pass and draws the sampler's noise; llguidance releases
        the GIL while it works. Until ``PendingMasks.wait`` returns, the
        states are the worker's: nothing else may touch them.
        """
        states = list(states)
        bitmask = new_bitmask(len(states), self.vocab_size, allow_all=False)  # fill_bitmasks writes every row
        with self._lock:
            if self._closed:
                raise RuntimeError("this GrammarCompiler is closed")
            if self._worker is None:
                self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidyrun-grammar-masks")
            future = self._worker.submit(self.fill_bitmasks, states, bitmask)
        return PendingMasks(states, bitmask, future)

    def close(self) -> None:
        """Join the worker thread (after the fill it may be running); idempotent. ``fill_later`` refuses after."""
        with self._lock:
            worker, self._worker, self._closed = self._worker, None, True
        if worker is not None:
            worker.shutdown(wait=True)


class PendingMasks:
    """A step's masks being filled on the compiler's worker thread (``GrammarCompiler.fill_later``)."""

    def __init__(self, states: list[GrammarState], bitmask: torch.Tensor, future: Future) -> None:
        self.states = states
        self._bitmask = bitmask
        self._future = future

    def wait(self) -> torch.Tensor:
        """The filled bitmask (host int32 [len(states), words]); re-raises what the fill raised."""
        self._future.result()
        return self._bitmask

    def settle(self) -> None:
        """Wait without raising: the states are the caller's again (cleanup after a failed step)."""
        self._future.exception()
