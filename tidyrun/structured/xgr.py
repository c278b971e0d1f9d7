"""The xgrammar backend: plain JSON schemas and choices under "auto" (``compiler.py`` chooses).

xgrammar precomputes, per grammar position, which tokens are allowed
whatever the context, so a mask costs tens of microseconds even inside a
length-bounded string, where llguidance's lexer walks the vocabulary
(measured in ``__init__.py``). But it silently fails to enforce much of
JSON Schema: random walks (each step a token drawn uniformly among the
allowed ones, the result checked with ``jsonschema``) produced invalid
documents under ``allOf``, ``not``, ``if``, ``uniqueItems``, ``contains``,
``pattern`` beside ``minLength``, ``enum`` beside a ``type`` its values do
not have, ``$ref`` or ``anyOf`` beside other keywords, ``required`` names
missing from ``properties``, ``patternProperties`` overlapping a property,
``multipleOf`` on numbers, and type-specific keywords without a ``type``.
So ``enforces`` admits only a plain shape (below) that walks found enforced;
everything else goes to llguidance, which enforces it or refuses it by name.
Regexes stay with llguidance too: xgrammar's ``.`` matches a newline (Python's
and llguidance's do not), it misreads POSIX classes, and it compiles them
10-100x slower.
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

# Keywords that constrain nothing (allowed anywhere in the plain shape).
_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment",
                          "deprecated", "readOnly", "writeOnly"})
# The plain shape: per type, the keywords xgrammar was seen to enforce there. Every schema node names one
# type (or is an ``enum`` of strings alone); enums hold values of their node's type.
_PLAIN = {"object": frozenset({"type", "properties", "required", "additionalProperties"}),
          "array": frozenset({"type", "items", "minItems", "maxItems"}),
          "string": frozenset({"type", "minLength", "maxLength", "enum"}),
          "integer": frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "enum"}),
          "number": frozenset({"type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}),
          "boolean": frozenset({"type"}), "null": frozenset({"type"})}
_ENUM_TYPES = {"string": str, "integer": int}
# xgrammar's messages start with a time and its C++ source line: "[04:02:48] /project/cpp/x.cc:94: ".
_WHERE = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


def enforces(spec: StructuredOutputsParams) -> bool:
    """Whether xgrammar enforces everything ``spec`` asks (else llguidance takes it under "auto")."""
    kind = spec.kind
    if kind in ("json", "json_object"):
        return spec.whitespace_pattern is None and _plain(schema_of(spec))
    return kind == "choice"


def _plain(node) -> bool:
    """Whether a schema node has the plain shape (``_PLAIN``), recursively."""
    if not isinstance(node, dict):
        return False
    keys = set(node) - _ANNOTATIONS
    kind = node.get("type")
    if kind is None:  # only an enum of strings stands without a type
        values = node.get("enum")
        return keys == {"enum"} and isinstance(values, list) and bool(values) and all(isinstance(v, str)
                                                                                      for v in values)
    if not isinstance(kind, str) or kind not in _PLAIN or not keys <= _PLAIN[kind]:
        return False
    if "enum" in node:
        values, of = node["enum"], _ENUM_TYPES[kind]
        if not (isinstance(values, list) and values and all(type(v) is of for v in values)):
            return False
    for key in ("minLength", "maxLength", "minItems", "maxItems"):
        if key in node and not (type(node[key]) is int and node[key] >= 0):
            return False
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):  # draft 4's booleans go elsewhere
        if key in node and type(node[key]) not in (int, float):
            return False
    if kind == "object":
        props = node.get("properties", {})
        required = node.get("required", [])
        extra = node.get("additionalProperties", True)
        return (isinstance(props, dict) and all(_plain(v) for v in props.values())
                and isinstance(required, list) and all(isinstance(r, str) and r in props for r in required)
                and (isinstance(extra, bool) or _plain(extra)))
    if kind == "array":
        return "items" not in node or _plain(node["items"])
    return True


def _json_grammar(xgrammar, spec: StructuredOutputsParams) -> str:
    r"""xgrammar's grammar (EBNF) for a JSON schema request, with its length-bounded strings mended.

    Why mended: xgrammar 0.2.9 writes a string with ``minLength`` / ``maxLength`` as characters of
    ``[^"\\\r\n]``, which admits raw control characters (a tab), so ``json.loads`` refused walks under
    such a schema. Every use of that class (a rule of its own, or inlined at ``maxLength: 1``) gets JSON's
    own, ``[^\0-\x1f"\\]``; the rest of the grammar is xgrammar's.
    """
    # strict_mode=False: JSON Schema's own defaults (objects open unless the schema closes them), the same
    # grammar llguidance builds; disable_additional_properties closes them. Compact JSON has no space after
    # ":" or "," (xgrammar's default separators have one).
    compact = spec.disable_any_whitespace
    grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema_of(spec)), strict_mode=False,
                                                any_whitespace=not compact,
                                                separators=(",", ":") if compact else None)
    text = str(grammar).replace(_LAX_CHARS, _JSON_CHARS)
    return text


_LAX_CHARS = r'[^\"\\\r\n]'
_JSON_CHARS = r'[^\0-\x1f\"\\]'


class XGrammar:
    """One compiled grammar; sequences each get a matcher (~30-80 us to build)."""

    backend = "xgrammar"

    def __init__(self, compiled, layout: MaskLayout, tokenizer) -> None:
        self.compiled = compiled
        self._tokenizer = tokenizer
        self._layout = layout

    def new_state(self, compiler) -> XGrammarState:
        import xgrammar

        return XGrammarState(xgrammar.GrammarMatcher(self.compiled), self._layout, compiler, self._tokenizer)


class XGrammarState(GrammarState):
    backend = "xgrammar"

    def __init__(self, matcher, layout: MaskLayout, compiler, tokenizer) -> None:
        super().__init__(layout, compiler)
        self.matcher = matcher
        self._tokenizer = tokenizer  # names a refused token's text
        self._only_stop: bool | None = None  # whether only EOS may follow; computed once per state

    def _advance(self, token_id: int) -> bool:
        self._only_stop = None
        return bool(self.matcher.accept_token(token_id))

    def _why_refused(self, token_id: int) -> str:
        try:
            text = repr(self._tokenizer.decode([token_id]))
        except Exception:  # noqa: BLE001 - an id past the tokenizer: the id alone says it
            text = "(no text)"
        return f"token {token_id} {text} is not allowed by the grammar here"

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

    def __init__(self, hf_tokenizer, layout: MaskLayout, threads: int) -> None:
        self._hf_tokenizer = hf_tokenizer
        self._layout = layout
        self._threads = threads
        self._compiler = None
        self._refusal: InvalidRequestError | None = None  # the tokenizer xgrammar could not read: asked once
        self._batch = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> XGrammar:
        import xgrammar

        compiler = self._grammar_compiler()
        kind = spec.kind
        try:
            if kind in ("json", "json_object"):
                compiled = compiler.compile_grammar(_json_grammar(xgrammar, spec))
            elif kind == "regex":
                compiled = compiler.compile_regex(spec.regex)
            elif kind == "choice":
                compiled = compiler.compile_grammar("root ::= " + " | ".join(
                    json.dumps(c, ensure_ascii=False) for c in spec.choice))
            else:  # "grammar": GBNF / EBNF, as vLLM's xgrammar backend reads it (validate() admits no other kind)
                compiled = compiler.compile_grammar(spec.grammar)
        except (RuntimeError, ValueError) as exc:  # xgrammar raises these for grammars it cannot read
            raise invalid(kind, _WHERE.sub("", str(exc))) from None
        return XGrammar(compiled, self._layout, self._hf_tokenizer)

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
            if self._refusal is not None:
                raise self._refusal
            if self._compiler is None:
                import xgrammar

                try:
                    info = _tokenizer_info(xgrammar, self._hf_tokenizer, self._layout)
                except Exception as exc:  # noqa: BLE001 - any tokenizer xgrammar cannot read is the same refusal
                    self._refusal = InvalidRequestError(
                        f"structured outputs through xgrammar are not available for this model's tokenizer "
                        f"({type(self._hf_tokenizer).__name__}): {exc}")
                    raise self._refusal from exc
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
    tokens). Every added token goes, special or not, as llguidance keeps them
    all out of text.
    """
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=layout.lib_vocab,
                                                   stop_token_ids=layout.eos_token_ids or None)
    special = set(getattr(hf_tokenizer, "all_special_ids", ()))
    special.update(getattr(hf_tokenizer, "added_tokens_decoder", {}))
    vocab = list(info.decoded_vocab)
    special.update(range(len(hf_tokenizer), len(vocab)))  # padding rows of wider logits: no token at all
    for token in special:
        if 0 <= token < len(vocab):
            vocab[token] = b""
    return xgrammar.TokenizerInfo(vocab, xgrammar.VocabType.RAW, vocab_size=layout.lib_vocab,
                                  stop_token_ids=list(info.stop_token_ids))
