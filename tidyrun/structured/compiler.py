"""Per engine: compiles ``StructuredOutputsParams`` into grammars, states, and a step's masks."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Sequence

import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from . import guidance, xgr
from .guidance import GuidanceBackend
from .mask import MaskLayout
from .specs import cache_key
from .state import GrammarState

# Compiled grammars kept per engine; a request with a grammar seen recently skips compilation.
_CACHE_SIZE = 128
_GUIDANCE_NAMES = ("guidance", "llguidance")


class GrammarCompiler:
    """Per engine (no module-level state): compiles ``StructuredOutputsParams`` into grammars and states.

    Built once from the engine's tidyrun Tokenizer and the model's vocab size
    (the logits width, which may exceed ``len(tokenizer)``). Each library's
    view of the tokenizer (~0.3-1 s to build) is built on its first
    ``compile``: engines that never see a structured request never pay for it.
    ``compile`` / ``new_state`` may be called from several threads.

    Which library (``StructuredOutputsParams.backend``, vLLM's names):
    "xgrammar"; "guidance" (or "llguidance"); None / "auto": xgrammar when it
    enforces everything the request asks (``xgr.enforces``: JSON schemas of
    the keywords it enforces, regexes, choices), else llguidance (Lark and
    GBNF grammars, ``whitespace_pattern``, other schema keywords), and
    llguidance again when xgrammar refuses a grammar (``disable_fallback``
    keeps xgrammar's refusal). A grammar both refuse gets llguidance's
    message, which names the problem more precisely.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], threads: int | None = None,
                 lanes: int = 64) -> None:
        """``threads``: the libraries' pool size for ``fill_bitmasks`` (None: 80% of the usable cores, at most
        32). ``lanes``: how many times llguidance builds a grammar at most, as sequences need them (see
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
        hf = tokenizer.hf_tokenizer
        self._layout = MaskLayout(self.vocab_size, max(self.vocab_size, len(tokenizer)), self.eos_token_ids)
        self._backends = {"guidance": GuidanceBackend(hf, self._layout, threads, lanes),
                          "xgrammar": xgr.XGrammarBackend(hf, self._layout, threads)}
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    # -- compiling ------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec`` (cached per spec, LRU); InvalidRequestError naming the problem.
        Its ``backend`` says which library took it."""
        if not isinstance(spec, StructuredOutputsParams):
            raise InvalidRequestError("structured outputs must be a StructuredOutputsParams")
        spec.validate()
        key = cache_key(spec)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        compiled = self._build(spec)  # outside the lock: a large grammar must not stall other requests
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _build(self, spec: StructuredOutputsParams):
        choice = spec.backend or "auto"
        if choice in _GUIDANCE_NAMES:
            return self._backends["guidance"].compile(spec)
        if choice == "xgrammar":
            return self._backends["xgrammar"].compile(spec)
        if not xgr.enforces(spec):  # "auto" (validate() refused any other name)
            return self._backends["guidance"].compile(spec)
        guidance.grammar_text(spec)  # llguidance's checks first (~1 ms): a malformed schema gets its clear refusal
        try:
            return self._backends["xgrammar"].compile(spec)
        except InvalidRequestError:
            if spec.disable_fallback:
                raise
            return self._backends["guidance"].compile(spec)

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh state at the start of ``spec``'s grammar, for one sequence."""
        return self.compile(spec).new_state(self)

    # -- a step's masks ---------------------------------------------------------------------

    def advance(self, states: Sequence[GrammarState]) -> None:
        """Advance every state past its token handed over with ``accept_later``, each library's rows together."""
        for name, group in self._by_backend(states).items():
            waiting = [(s, s.take_pending()) for s in group]
            waiting = [(s, t) for s, t in waiting if t is not None]
            valid = [(s, t) for s, t in waiting if t >= 0]
            for state, token in waiting:
                if token < 0:
                    state._record(token, False)
            if valid:
                results = self._backends[name].advance_many([s for s, _ in valid], [t for _, t in valid])
                for (state, token), ok in zip(valid, results):
                    state._record(token, bool(ok))

    def fill_bitmasks(self, states: Sequence[GrammarState], bitmask: torch.Tensor,
                      rows: Sequence[int] | None = None) -> None:
        """``states[i].fill_bitmask(bitmask, rows[i])`` for all i (rows default to 0..len-1), on the libraries'
        threads, after advancing every state past its waiting token (``advance``).

        Same result as the loop; worth it when many constrained sequences
        share a step (one by one, a mask costs ~10-1000 us).
        """
        self._layout.check(bitmask)
        rows = list(range(len(states))) if rows is None else [int(r) for r in rows]
        if len(rows) != len(states):
            raise ValueError(f"{len(states)} states but {len(rows)} rows")
        self._layout.check_rows(bitmask, rows)
        self.advance(states)
        live: dict[str, tuple[list, list]] = {}
        for state, row in zip(states, rows):
            if state._refused is not None:
                self._layout.stop_only(bitmask, row)
            else:
                group = live.setdefault(state.backend, ([], []))
                group[0].append(state)
                group[1].append(row)
        for name, (group, group_rows) in live.items():
            self._backends[name].fill_many(group, bitmask, group_rows)

    @staticmethod
    def _by_backend(states: Sequence[GrammarState]) -> dict[str, list[GrammarState]]:
        groups: dict[str, list[GrammarState]] = {}
        for state in states:
            groups.setdefault(state.backend, []).append(state)
        return groups
