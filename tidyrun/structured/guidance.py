"""llguidance's side of structured outputs: compiled grammars, their states, its thread pool."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence

import llguidance
import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from .mask import MaskLayout
from .specs import invalid, schema_of
from .state import GrammarState


class GuidanceGrammar:
    """One checked grammar and the unadvanced matchers that sequences copy (copying is ~100x cheaper than
    building).

    Why several templates (``lanes``): an llguidance matcher shares its lexer, behind one lock, with every
    deep copy made from it, so the masks of sequences copied from one template are computed one at a
    time however many threads fill them. Measured on the H200 host (16 cores, llguidance's pool of 12
    threads), 64 sequences under one JSON schema took 7.2 ms a step to fill, ~110 us a row: no faster
    than one thread. Sequences are dealt round-robin over ``lanes`` independently built templates
    (built on first use, ~0.7 ms each for a 3-field schema), so up to ``lanes`` masks are computed at
    once. On the H200 host, 64 sequences deep inside strings filled in 1.90 ms a step from 64 lanes
    against 2.71 ms from 12 (12 threads); a template costs ~1 KiB, so lanes default to 64.
    """

    def __init__(self, kind: str, grammar: str, build: Callable[[], llguidance.LLMatcher], lanes: int,
                 layout: MaskLayout) -> None:
        self.kind = kind
        self.grammar = grammar  # llguidance's serialized grammar (useful in error reports)
        first = build()
        if first.is_error():
            raise invalid(kind, first.get_error())
        self._templates = [first]
        self._build = build
        self._lanes = max(1, lanes)
        self._layout = layout
        self._next = 0
        self._lock = threading.Lock()

    def new_state(self, compiler) -> GrammarState:
        with self._lock:
            lane = self._next % self._lanes
            self._next += 1
            if lane == len(self._templates):
                self._templates.append(self._build())
            template = self._templates[lane]
        return GrammarState(template.deep_copy(), self._layout, compiler)


class GuidanceBackend:
    """llguidance's view of the tokenizer (~1 s to build, so built on first use) and its thread pool."""

    def __init__(self, hf_tokenizer, layout: MaskLayout, eos_token_ids: frozenset[int], threads: int,
                 lanes: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._eos_token_ids = sorted(eos_token_ids)
        self._layout = layout
        self._threads = threads
        self._lanes = lanes
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> GuidanceGrammar:
        grammar = grammar_text(spec)
        tokenizer = self._ll_tokenizer()
        return GuidanceGrammar(spec.kind, grammar, lambda: llguidance.LLMatcher(tokenizer, grammar, log_level=0),
                               self._lanes, self._layout)

    def fill_job(self, states: Sequence[GrammarState], tokens: Sequence[int | None], bitmask: torch.Tensor,
                 rows: Sequence[int]) -> Callable[[], None]:
        """A call that advances each state past its token (None: none waits), all on the pool's threads (a
        refused token leaves that matcher in llguidance's error state, as ``consume_token`` does), then
        writes the states' masks into ``bitmask`` rows. Its argument lists are built here: the thread
        that runs it holds the GIL only to enter llguidance, which releases it while it works."""
        pool = self._pool()
        advance = [(s.matcher, t) for s, t in zip(states, tokens) if t is not None]
        layout = self._layout
        if layout.direct and bitmask.is_contiguous():
            masks = [(s.matcher, r) for s, r in zip(states, rows)]
            ptr, row_bytes, n_rows = bitmask.data_ptr(), layout.words * 4, bitmask.shape[0]

            def write_masks() -> None:
                if masks:
                    pool.unsafe_compute_mask_ptr(masks, ptr, row_bytes, n_rows)
                if layout.cut:
                    for row in rows:
                        layout.clear_tail(bitmask[row])
        else:
            def write_masks() -> None:
                for state, row in zip(states, rows):
                    state.fill_unchecked(bitmask, row)

        def fill() -> None:
            if advance:
                pool.consume_token_par(advance)
            write_masks()
        return fill

    def _pool(self) -> llguidance.LLExecutor:
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self._threads)
            return self._executor

    def _ll_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                eos = self._eos_token_ids or None  # None: the tokenizer's own eos token
                try:
                    mended = _byte_level_decoding(self._hf_tokenizer)
                    self._tokenizer = (
                        llguidance.LLTokenizer(mended, n_vocab=self._layout.lib_vocab, eos_token=eos) if mended
                        else llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=self._layout.lib_vocab,
                                                          eos_token=eos))
                except ValueError as exc:  # a slow (Python) tokenizer, or one llguidance cannot read
                    raise InvalidRequestError(f"structured outputs are not available for this model's tokenizer "
                                              f"({type(self._hf_tokenizer).__name__}): {exc}") from exc
            return self._tokenizer


def _byte_level_decoding(hf_tokenizer) -> str | None:
    """The tokenizer's JSON with a plain ByteLevel decoder, when it pre-tokenizes byte-level but decodes
    otherwise; None when nothing needs mending.

    Why: transformers 5.17 builds GGUF byte-level tokenizers (the default model's) with the decoder
    ``Sequence[ByteFallback, Fuse, Replace("▁", " "), ByteLevel]``. Its own decoding is right, but llguidance
    then reads the vocabulary as sentencepiece pieces, ``Ġsplit`` as the bytes ``Äsplit``, and refuses the
    tokens its own masks allowed (found on the H200 host; transformers 5.25 builds a plain ByteLevel
    decoder).
    """
    backend = getattr(hf_tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    data = json.loads(backend.to_str())
    decoder = data.get("decoder") or {}
    if not _has_type(data.get("pre_tokenizer"), "ByteLevel") or decoder.get("type") == "ByteLevel":
        return None
    data["decoder"] = {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    data["padding"] = data["truncation"] = None
    return json.dumps(data)


def _has_type(node, kind: str) -> bool:
    """Whether a tokenizers component (JSON), or one inside a Sequence of them, is of ``kind``."""
    if isinstance(node, dict):
        return node.get("type") == kind or any(_has_type(v, kind) for v in node.values())
    if isinstance(node, list):
        return any(_has_type(v, kind) for v in node)
    return False


def _json_options(spec: StructuredOutputsParams) -> dict:
    options: dict = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None and not spec.disable_any_whitespace:
        options["whitespace_pattern"] = spec.whitespace_pattern
    return options


def grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec``; InvalidRequestError for what cannot even be translated."""
    kind = spec.kind
    try:
        if kind in ("json", "json_object"):
            return llguidance.LLMatcher.grammar_from_json_schema(schema_of(spec), defaults=_json_options(spec))
        if kind == "regex":  # \d and \w are ASCII, as in vLLM's default backend (xgrammar) and JSON Schema
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec.regex, 'dw')}/")
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        # "grammar" (validate() admits no other kind): Lark, or GBNF / EBNF ("root ::= ..."), as vLLM's
        # guidance backend reads it
        return llguidance.grammar_from("grammar", spec.grammar)
    except InvalidRequestError:  # schema_of's own refusal (a ValueError too), already worded
        raise
    except ValueError as exc:
        raise invalid(kind, str(exc)) from None
