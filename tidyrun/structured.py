r"""Structured outputs: a grammar per request, turned into a token mask on the logits.

The grammar library is llguidance. Both candidates were measured on the
default model's tokenizer (SmolLM2-135M, vocab 49152) on 2 shared CPU cores,
with random walks that draw uniformly among the allowed tokens (200 steps):

=====================================  ===================  =====================
                                       llguidance 1.9.1     xgrammar 0.2.9
=====================================  ===================  =====================
install (beyond torch, transformers)   3 MB abi3 wheel,     1.3 MB wheel +
                                       no dependencies      apache-tvm-ffi (13 MB)
                                                            + pydantic + triton
                                                            (1 GB on CPU hosts)
tokenizer info                         850-1080 ms          340 ms
compile: JSON schema, 3 fields         1.4 ms               13 ms
compile: JSON schema, 40 objects       47 ms                97 ms
compile: regex \d{3}-\d{4}             2.4 ms               0.2 ms
compile: regex [a-z]{1,200}@[a-z]...   6 ms                 998 ms
compile: choice (4 strings)            2.0 ms               0.25 ms
compile: any JSON object               0.9 ms               6.8 ms
new matcher from a compiled grammar    7-24 us              28-78 us
next-token mask, per token             20-110 us            5-25 us
  (first mask of a new matcher)        up to 0.5 ms         up to 0.04 ms
advance the matcher, per token         9-45 us              6-12 us
=====================================  ===================  =====================

xgrammar's masks are ~5x cheaper per token, but llguidance is what tidyrun
wants: one dependency-free wheel in the user's process (xgrammar pulls in
triton even on CPU-only installs), and a compile time that stays in
milliseconds (grammars are built lazily) where xgrammar stalled a request
for a second on a bounded-repetition regex. For 200 constrained sequences
at mid-grammar states one step's masks took 3-24 ms one by one and 4-7 ms
through ``GrammarCompiler.fill_bitmasks`` (llguidance's thread pool) on the
same 2 cores (the pool takes up to 80% of the cores, at most 32).

The mask is a host int32 bitmask (bit ``t % 32`` of word ``t // 32`` set =
token ``t`` allowed), filled per sequence on the host and applied to the
logits on their device with one copy (``apply_bitmask``).
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import MappingProxyType

import llguidance
import torch

from .errors import InvalidRequestError
from .sampling_params import StructuredOutputsParams

# Compiled grammars kept per engine; a request with a grammar seen recently skips compilation.
_CACHE_SIZE = 128
# Grammar errors from llguidance can quote the whole grammar; keep the part that names the problem.
_MAX_ERROR_CHARS = 600


def _invalid(kind: str, detail: str) -> InvalidRequestError:
    detail = detail.strip()
    if len(detail) > _MAX_ERROR_CHARS:
        detail = detail[:_MAX_ERROR_CHARS] + " ..."
    return InvalidRequestError(f"structured outputs: invalid {kind}: {detail}")


class CompiledGrammar:
    """One checked grammar and the unadvanced matchers that sequences copy (copying is ~100x cheaper than
    building).

    Why several templates (``lanes``): an llguidance matcher shares its lexer, behind one lock, with every
    deep copy made from it, so the masks of sequences copied from one template are computed one at a
    time however many threads fill them. Measured on the H200 host (16 cores, llguidance's pool of 12
    threads), 64 sequences under one JSON schema took 7.2 ms a step to fill, ~110 us a row: no faster
    than one thread. Sequences are dealt round-robin over ``lanes`` independently built templates
    (built on first use, ~0.7 ms each for a 3-field schema), so up to ``lanes`` masks are computed at
    once; on 2 cores, 64 sequences from two lanes filled in 139 us a row against 213 us from one. More
    lanes than threads still pay: two rows of one lane that land on different threads wait for each
    other. On the H200 host, 64 sequences deep inside strings filled in 1.90 ms a step from 64 lanes
    against 2.71 ms from 12 (12 threads); a template costs ~1 KiB, so lanes default to 64.
    """

    def __init__(self, kind: str, grammar: str, template: llguidance.LLMatcher,
                 build: Callable[[], llguidance.LLMatcher] | None = None, lanes: int = 1) -> None:
        self.kind = kind
        self.grammar = grammar  # llguidance's serialized grammar (useful in error reports)
        self._templates = [template]
        self._build = build
        self._lanes = max(1, lanes) if build is not None else 1
        self._next = 0
        self._lock = threading.Lock()

    def new_matcher(self) -> llguidance.LLMatcher:
        with self._lock:
            lane = self._next % self._lanes
            self._next += 1
            if lane == len(self._templates):
                self._templates.append(self._build())
            template = self._templates[lane]
        return template.deep_copy()


class GrammarState:
    """Per generated sequence: where the sequence is in the grammar (host only).

    Not thread-safe: one sequence's state is advanced by one thread at a time.
    """

    def __init__(self, matcher: llguidance.LLMatcher, layout: _MaskLayout, compiler: GrammarCompiler) -> None:
        self._matcher = matcher
        self._layout = layout
        self.compiler = compiler  # fills the masks of a whole step at once (``GrammarCompiler.fill_bitmasks``)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed at the next step into ``bitmask[row]`` (int32 [rows, ceil(vocab/32)], CPU).

        When the grammar is complete only the model's EOS ids are allowed, so
        the sequence stops; after a refused ``accept`` (an error state) the same.
        """
        self._layout.check(bitmask)
        if not 0 <= row < bitmask.shape[0]:
            raise IndexError(f"bitmask row {row} out of range for {bitmask.shape[0]} rows")
        self._layout.fill(self._matcher, bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False if the grammar did not allow it (the state then allows only EOS)."""
        token_id = int(token_id)
        if token_id < 0:
            return False
        return self._matcher.consume_token(token_id)

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete (or the state refused a token): only EOS is allowed."""
        return self._matcher.is_stopped()

    @property
    def error(self) -> str | None:
        """Why the state refused a token, or None while every accepted token was allowed."""
        return self._matcher.get_error() or None

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher (``GrammarCompiler.fill_bitmasks`` hands several to one thread pool)."""
        return self._matcher


class _MaskLayout:
    """How llguidance's mask (one bit per tokenizer token) maps onto the logits' width.

    llguidance is built with ``n_vocab = max(vocab_size, len(tokenizer))``:
    when the logits are wider than the tokenizer the padding tokens have no
    bytes and llguidance never allows them; when the tokenizer is wider
    (added tokens the model cannot produce) the mask is cut to the logits'
    width (through a scratch row when it has more words) and the bits past
    ``vocab_size`` are cleared.
    """

    def __init__(self, vocab_size: int, ll_vocab: int) -> None:
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.ll_words = (ll_vocab + 31) // 32
        self.cut = ll_vocab > vocab_size

    @property
    def direct(self) -> bool:
        """llguidance writes straight into a bitmask row (same number of words)."""
        return self.words == self.ll_words

    def check(self, bitmask: torch.Tensor) -> None:
        if (bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.device.type != "cpu"
                or bitmask.shape[1] != self.words or bitmask.stride(1) != 1):
            raise ValueError(f"bitmask must be a CPU int32 tensor [rows, {self.words}] with contiguous rows "
                             f"(new_bitmask builds one); got {bitmask.dtype} {tuple(bitmask.shape)} on "
                             f"{bitmask.device}")

    def fill(self, matcher: llguidance.LLMatcher, bitmask: torch.Tensor, row: int) -> None:
        target = bitmask[row]
        if self.direct:
            matcher.unsafe_compute_mask_ptr(target.data_ptr(), self.words * 4)
        else:
            wide = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
            target.copy_(wide[:self.words])
        if self.cut:
            self.clear_tail(target)

    def clear_tail(self, row: torch.Tensor) -> None:
        """Clear the bits of the last word that lie past ``vocab_size``."""
        extra = self.words * 32 - self.vocab_size
        if extra:
            row[-1] &= (1 << (32 - extra)) - 1


class GrammarCompiler:
    """Per engine (no module-level state): compiles ``StructuredOutputsParams`` into grammars and states.

    Built once from the engine's tidyrun Tokenizer and the model's vocab size
    (the logits width, which may exceed ``len(tokenizer)``). llguidance's view
    of the tokenizer takes ~1 s to build, so it is built on the first
    ``compile``: engines that never see a structured request never pay for it.
    ``compile`` / ``new_state`` may be called from several threads.
    """

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: frozenset[int], threads: int | None = None,
                 lanes: int = 64) -> None:
        """``threads``: llguidance's pool size for ``fill_bitmasks`` (None: its own default, 80% of the usable
        cores, at most 32). ``lanes``: how many times a grammar is built at most, as sequences need them (see
        ``CompiledGrammar``)."""
        if vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self._hf_tokenizer = tokenizer.hf_tokenizer
        self._tokenizer_len = len(tokenizer)
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        bad = [e for e in self.eos_token_ids if not 0 <= e < self.vocab_size]
        if bad:
            raise ValueError(f"eos token ids {sorted(bad)} are outside the vocabulary (size {self.vocab_size})")
        self._layout = _MaskLayout(self.vocab_size, max(self.vocab_size, self._tokenizer_len))
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._threads = threads if threads is not None else max(1, min(32, int(0.8 * len(os.sched_getaffinity(0)))))
        if self._threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        if lanes < 1:
            raise ValueError(f"lanes must be at least 1, got {lanes}")
        self._lanes = lanes
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    # -- compiling ------------------------------------------------------------------------

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The compiled grammar of ``spec`` (cached per spec, LRU); InvalidRequestError naming the problem."""
        if not isinstance(spec, StructuredOutputsParams):
            raise InvalidRequestError("structured outputs must be a StructuredOutputsParams")
        spec.validate()
        key = _cache_key(spec)
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

    def new_state(self, spec: StructuredOutputsParams) -> GrammarState:
        """A fresh state at the start of ``spec``'s grammar, for one sequence."""
        return GrammarState(self.compile(spec).new_matcher(), self._layout, self)

    def fill_bitmasks(self, states: Sequence[GrammarState], bitmask: torch.Tensor,
                      rows: Sequence[int] | None = None) -> None:
        """``states[i].fill_bitmask(bitmask, rows[i])`` for all i (rows default to 0..len-1), on llguidance's threads.

        Same result as the loop; worth it when many constrained sequences
        share a step (the loop costs ~20-110 us per sequence on one core).
        """
        self._layout.check(bitmask)
        rows = list(range(len(states))) if rows is None else [int(r) for r in rows]
        if len(rows) != len(states):
            raise ValueError(f"{len(states)} states but {len(rows)} rows")
        if any(not 0 <= r < bitmask.shape[0] for r in rows) or len(set(rows)) != len(rows):
            raise IndexError(f"rows must be distinct and below {bitmask.shape[0]}")
        if not states:
            return
        if not self._layout.direct or not bitmask.is_contiguous():
            for state, row in zip(states, rows):
                state.fill_bitmask(bitmask, row)
            return
        with self._lock:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(num_threads=self._threads)
            executor = self._executor
        executor.unsafe_compute_mask_ptr([(s.matcher, r) for s, r in zip(states, rows)], bitmask.data_ptr(),
                                         self._layout.words * 4, bitmask.shape[0])
        if self._layout.cut:
            for row in rows:
                self._layout.clear_tail(bitmask[row])

    def _build(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        kind = spec.kind
        grammar = _grammar_text(spec)
        tokenizer = self._llguidance_tokenizer()

        def build() -> llguidance.LLMatcher:
            return llguidance.LLMatcher(tokenizer, grammar, log_level=0)

        matcher = build()
        if matcher.is_error():
            raise _invalid(_KIND_NAMES.get(kind, kind), matcher.get_error())
        return CompiledGrammar(kind, grammar, matcher, build, self._lanes)

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = self._make_ll_tokenizer()
            return self._ll_tokenizer

    def _make_ll_tokenizer(self) -> llguidance.LLTokenizer:
        import llguidance.hf

        eos = sorted(self.eos_token_ids) or None  # None: the tokenizer's own eos token
        try:
            return llguidance.hf.from_tokenizer(self._hf_tokenizer, n_vocab=max(self.vocab_size, self._tokenizer_len),
                                                eos_token=eos)
        except ValueError as exc:  # a slow (Python) tokenizer, or one llguidance cannot read
            raise InvalidRequestError(f"structured outputs are not available for this model's tokenizer "
                                      f"({type(self._hf_tokenizer).__name__}): {exc}") from exc


_KIND_NAMES = MappingProxyType({"json": "JSON schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                                "json_object": "json_object"})


def _json_options(spec: StructuredOutputsParams) -> dict:
    options: dict = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None and not spec.disable_any_whitespace:
        options["whitespace_pattern"] = spec.whitespace_pattern
    return options


def _schema(spec: StructuredOutputsParams) -> dict:
    """The request's JSON schema as a dict (a copy: the caller's object is never changed)."""
    schema = spec.json
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise _invalid("JSON schema", f"not valid JSON ({exc})") from None
    if isinstance(schema, bool):  # JSON Schema allows true/false as whole schemas
        schema = {} if schema else {"not": {}}
    if not isinstance(schema, dict):
        raise _invalid("JSON schema", f"must be a JSON object, got {type(schema).__name__}")
    schema = copy.deepcopy(schema)
    if spec.disable_additional_properties:
        _close_objects(schema)
    return schema


def _close_objects(node) -> None:
    """Set ``additionalProperties: false`` on every object schema that does not say otherwise (vLLM's option)."""
    if isinstance(node, dict):
        if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        for value in node.values():
            _close_objects(value)
    elif isinstance(node, list):
        for value in node:
            _close_objects(value)


def _grammar_text(spec: StructuredOutputsParams) -> str:
    """llguidance's grammar for ``spec``; InvalidRequestError for what cannot even be translated."""
    kind = spec.kind
    try:
        if kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(_schema(spec), defaults=_json_options(spec))
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=_json_options(spec))
        if kind == "regex":  # \d and \w are ASCII, as in vLLM's default backend (xgrammar) and JSON Schema
            return llguidance.LLMatcher.grammar_from_lark(f"start: /{llguidance.regex_to_lark(spec.regex, 'dw')}/")
        if kind == "choice":
            return llguidance.grammar_from("choice", list(spec.choice))
        if kind == "grammar":  # Lark, or GBNF / EBNF ("root ::= ..."), as vLLM's guidance backend reads it
            return llguidance.grammar_from("grammar", spec.grammar)
    except ValueError as exc:
        raise _invalid(_KIND_NAMES[kind], str(exc)) from None
    raise InvalidRequestError(f"structured outputs: {kind} is not supported")


def _cache_key(spec: StructuredOutputsParams) -> tuple:
    """What determines the grammar; dict order is kept (it orders the JSON properties)."""
    kind = spec.kind
    if kind == "json":
        try:
            value = spec.json if isinstance(spec.json, str) else json.dumps(spec.json)
        except (TypeError, ValueError) as exc:  # a dict holding sets, objects, cycles ...
            raise _invalid("JSON schema", f"not serializable as JSON ({exc})") from None
        return (kind, value, spec.disable_any_whitespace, spec.whitespace_pattern, spec.disable_additional_properties)
    if kind == "json_object":
        return (kind, spec.disable_any_whitespace, spec.whitespace_pattern)
    if kind == "choice":
        return (kind, tuple(spec.choice))
    return (kind, getattr(spec, kind))


# -- the mask on the logits ---------------------------------------------------------------


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
    host. Bitmask row i applies to logits row ``rows[i]`` (all N rows, R == N,
    when ``rows`` is None). One copy of the mask to the device, then
    vectorized unpacking (no loop over tokens); the unpacked mask takes one
    byte per token (the words are read as little-endian bytes, as on every
    platform torch and llguidance run on).
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
    packed = bitmask.contiguous().to(dev).view(torch.uint8)  # [count, words * 4]: byte k holds tokens 8k..8k+7
    bits = torch.ones(8, dtype=torch.uint8, device=dev) << torch.arange(8, dtype=torch.uint8, device=dev)
    refused = ((packed.unsqueeze(-1) & bits) == 0).view(count, words * 32)[:, :vocab]
    if rows is None:
        logits.masked_fill_(refused, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.long).to(dev)
    logits[index] = logits[index].masked_fill(refused, float("-inf"))
