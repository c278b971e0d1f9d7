"""The xgrammar backend: JSON schemas, regexes and choices by default (``compiler.py`` chooses).

xgrammar precomputes, per grammar position, which tokens are allowed
whatever the context, so a mask costs tens of microseconds even inside a
length-bounded string, where llguidance's lexer walks the vocabulary
(measured in ``__init__.py``). It does not enforce every JSON Schema keyword
(it silently ignores ``allOf``, ``not``, ``if``, ``oneOf``'s exclusivity,
``uniqueItems``, ``contains`` ... : random walks under them produced
invalid documents), so ``enforces`` admits only schemas built from keywords
it was measured to enforce; the rest go to llguidance.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Sequence

import torch

from ..errors import InvalidRequestError
from ..sampling_params import StructuredOutputsParams
from .mask import MaskLayout
from .specs import invalid, schema_of
from .state import GrammarState

# Keywords xgrammar enforces (random walks under each produced only valid documents, xgrammar 0.2.9), and
# annotations that constrain nothing. ``format`` is left out: some formats are not enforced.
_SCHEMA_KEYWORDS = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "prefixItems", "enum", "const", "anyOf",
    "$ref", "$defs", "definitions", "minLength", "maxLength", "pattern", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minItems", "maxItems", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "dependentRequired",
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated", "readOnly",
    "writeOnly"})
# Keywords whose value maps names to subschemas, and those whose value is one subschema or a list of them.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "patternProperties"})
_SCHEMA_VALUES = frozenset({"additionalProperties", "items", "prefixItems", "anyOf", "propertyNames"})
# xgrammar expands a counted repetition into copies of its rule: `[a-z]{1,n}` took ~2 ms per unit of n to
# compile (450 ms at n=200, 2 shared cores) where llguidance takes ~2 ms; regexes counting past this go there.
_MAX_REGEX_COUNT = 32
_COUNT = re.compile(r"\{(\d+)(?:,(\d*))?\}")
# xgrammar's messages start with a time and its C++ source line: "[04:02:48] /project/cpp/x.cc:94: ".
_WHERE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def enforces(spec: StructuredOutputsParams) -> bool:
    """Whether xgrammar enforces everything ``spec`` asks (else llguidance takes it under "auto")."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        return spec.whitespace_pattern is None and _known_keywords(schema_of(spec))
    if kind == "regex":
        return all(int(hi or lo) <= _MAX_REGEX_COUNT for lo, hi in _COUNT.findall(spec.regex))
    return kind == "choice"


def _known_keywords(node) -> bool:
    if isinstance(node, bool):
        return True
    if not isinstance(node, dict):
        return False
    for key, value in node.items():
        if key not in _SCHEMA_KEYWORDS:
            return False
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict) or not all(_known_keywords(v) for v in value.values()):
                return False
        elif key in _SCHEMA_VALUES:
            values = value if isinstance(value, list) else [value]
            if not all(_known_keywords(v) for v in values):
                return False
    return True


def _json_grammar(xgrammar, spec: StructuredOutputsParams) -> str:
    r"""xgrammar's grammar (EBNF) for a JSON schema request, with its length-bounded strings mended.

    Why mended: xgrammar 0.2.9 writes a string with ``minLength`` / ``maxLength`` as characters of
    ``[^"\\\r\n]``, which admits raw control characters (a tab), so ``json.loads`` refused walks under
    such a schema. Those rules get JSON's own class, ``[^\0-\x1f"\\]``; the rest of the grammar is
    xgrammar's. A line of another shape is left alone (the random-walk tests check the result).
    """
    # strict_mode=False: JSON Schema's own defaults (objects open unless the schema closes them), the same
    # grammar llguidance builds; disable_additional_properties closes them. Compact JSON has no space after
    # ":" or "," (xgrammar's default separators have one).
    compact = spec.disable_any_whitespace
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema_of(spec)), strict_mode=False,
                                                any_whitespace=not compact,
                                                separators=(",", ":") if compact else None)
    lines = str(grammar).splitlines()
    return "\n".join(line.replace(_LAX_CHARS, _JSON_CHARS) if "_characters ::= " in line else line
                     for line in lines)


_LAX_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\]'


class XGrammar:
    """One compiled grammar; sequences each get a matcher (~30-80 us to build)."""

    backend = "xgrammar"

    def __init__(self, kind: str, compiled, layout: MaskLayout) -> None:
        self.kind = kind
        self.compiled = compiled
        self._layout = layout

    def new_state(self, compiler) -> XGrammarState:
        import xgrammar

        return XGrammarState(xgrammar.GrammarMatcher(self.compiled), self._layout, compiler)


class XGrammarState(GrammarState):
    backend = "xgrammar"

    def __init__(self, matcher, layout: MaskLayout, compiler) -> None:
        super().__init__(layout, compiler)
        self.matcher = matcher
        self._only_stop: bool | None = None  # whether only EOS may follow; computed once per state

    def _advance(self, token_id: int) -> bool:
        self._only_stop = None
        return bool(self.matcher.accept_token(token_id))

    def _why_refused(self, token_id: int) -> str:
        return f"token {token_id} is not allowed by the grammar here"

    def _complete(self) -> bool:
        """xgrammar's matcher terminates only when it accepts EOS; a complete grammar that allows nothing
        else (a closed JSON object) counts as complete here already, as llguidance's does."""
        if self.matcher.is_terminated():
            return True
        if not self.matcher.is_completed():
            return False
        if self._only_stop is None:
            wide = torch.empty(1, self._layout.lib_words, dtype=torch.int32)
            self.matcher.fill_next_token_bitmask(wide, 0)
            self._only_stop = self._layout.only_stop_allowed(wide[0])
        return self._only_stop

    def _fill(self, bitmask: torch.Tensor, row: int) -> None:
        if self._layout.direct:
            self.matcher.fill_next_token_bitmask(bitmask, row)
            self._layout.clear_tail(bitmask[row])
        else:
            wide = torch.empty(1, self._layout.lib_words, dtype=torch.int32)
            self.matcher.fill_next_token_bitmask(wide, 0)
            self._layout.write_wide(wide[0], bitmask, row)


class XGrammarBackend:
    """xgrammar's view of the tokenizer (~0.3 s, built on first use), its compiler and its thread pool."""

    name = "xgrammar"

    def __init__(self, hf_tokenizer, layout: MaskLayout, threads: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._layout = layout
        self._threads = threads
        self._compiler = None
        self._batch = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> XGrammar:
        import xgrammar

        compiler = self._grammar_compiler()
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                # strict_mode=False: JSON Schema's own defaults (objects open unless the schema closes them),
                # the same grammar llguidance builds; disable_additional_properties closes them.
                compiled = compiler.compile_grammar(_json_grammar(xgrammar, spec))
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in spec.choice))
            elif kind == "grammar":  # GBNF / EBNF, as vLLM's xgrammar backend reads it
                compiled = compiler.compile_grammar(spec.grammar)
            else:
                raise InvalidRequestError(f"structured outputs: {kind} is not supported")
        except (RuntimeError, ValueError) as exc:  # xgrammar raises these for grammars it cannot read
            raise invalid(kind, _WHERE.sub("", str(exc))) from None
        return XGrammar(kind, compiled, self._layout)

    def advance_many(self, states: Sequence[XGrammarState], tokens: Sequence[int]) -> list[bool]:
        # One call per row: 0.13 ms for 64 rows where BatchGrammarMatcher.batch_accept_token took 0.19 ms
        # (its result list is read element by element through tvm-ffi).
        return [state._advance(token) for state, token in zip(states, tokens)]

    def fill_many(self, states: Sequence[XGrammarState], bitmask: torch.Tensor, rows: Sequence[int]) -> None:
        if not self._layout.direct or not bitmask.is_contiguous():
            for state, row in zip(states, rows):
                state._fill(bitmask, row)
            return
        self._pool().batch_fill_next_token_bitmask([s.matcher for s in states], bitmask, list(rows))
        for row in rows:
            self._layout.clear_tail(bitmask[row])

    def _pool(self):
        import xgrammar

        with self._lock:
            if self._batch is None:
                self._batch = xgrammar.BatchGrammarMatcher(max_threads=self._threads)
            return self._batch

    def _grammar_compiler(self):
        with self._lock:
            if self._compiler is None:
                import xgrammar

                try:
                    info = _tokenizer_info(xgrammar, self._hf_tokenizer, self._layout)
                except Exception as exc:  # noqa: BLE001 - any tokenizer xgrammar cannot read is the same refusal
                    raise InvalidRequestError(f"structured outputs are not available for this model's tokenizer "
                                              f"({type(self._hf_tokenizer).__name__}): {exc}") from exc
                # Its own cache off: GrammarCompiler keeps a bounded one (xgrammar's default is unbounded).
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=self._threads, cache_enabled=False)
            return self._compiler


def _tokenizer_info(xgrammar, hf_tokenizer, layout: MaskLayout):
    """xgrammar's view of the vocabulary, with the tokenizer's special tokens given no text.

    Why: ``TokenizerInfo.from_huggingface`` reads ``<|im_start|>`` and the
    like as their literal text, so ``.*`` or a JSON string would admit them
    (found on the default model's tokenizer: none of its 17 added tokens was
    treated as special). A token with no bytes is one xgrammar never allows;
    the EOS ids stay allowed where the grammar may end (they are its stop
    tokens). llguidance marks the same tokens special on its own.
    """
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=layout.lib_vocab,
                                                   stop_token_ids=layout.eos_token_ids or None)
    special = set(getattr(hf_tokenizer, "all_special_ids", ()))
    special.update(i for i, t in getattr(hf_tokenizer, "added_tokens_decoder", {}).items() if t.special)
    vocab = list(info.decoded_vocab)
    special.update(range(len(hf_tokenizer), len(vocab)))  # padding rows of wider logits: no token at all
    for token in special:
        if 0 <= token < len(vocab):
            vocab[token] = b""
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=layout.lib_vocab,
                                  stop_token_ids=list(info.stop_token_ids))
