"""Structured outputs (tidyrun/structured.py) on the default model's tokenizer, and through the engine.

The grammar tests are random walks: at every step the walk draws uniformly
(seeded) among the tokens the mask allows, so they visit far stranger
token sequences than a model would; every finished walk must satisfy its
constraint, checked by an independent checker (``re.fullmatch``, ``json.loads``
and a hand-written schema check).
"""

from __future__ import annotations

import json
import re
import threading
import time

import numpy as np
import pytest
import torch

from tidyrun import LLM, InvalidRequestError, SamplingParams, StructuredOutputsParams
from tidyrun.loader import open_model_source
from tidyrun.structured import GrammarCompiler, apply_bitmask, new_bitmask
from tidyrun.tokenizer import Tokenizer

PHONE = r"\d{3}-\d{4}"
WORDS = r"(yes|no|maybe)( [a-z]{1,5}){0,3}\."
# Choices that are prefixes of each other, and ones that need escaping in a grammar.
CHOICES = ["yes", "yes sir", "banana split", 'say "hi"', "naïve\ncafé", "back\\slash"]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9}},
                  "required": ["x"], "additionalProperties": False},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
GBNF = 'root ::= subject " " verb "."\nsubject ::= "the cat" | "Alice" | [0-9] [0-9]?\nverb ::= "sees" | "likes"'
LARK = 'start: subject " " verb "."\nsubject: "the cat" | "Alice" | /[0-9]{1,2}/\nverb: "sees" | "likes"'
SENTENCE = r"(the cat|Alice|[0-9]{1,2}) (sees|likes)\."


def check_person(obj) -> None:
    """PERSON's constraints, checked by hand."""
    assert isinstance(obj, dict) and {"name", "age", "ok"} <= obj.keys() <= set(PERSON["properties"]), obj
    assert isinstance(obj["name"], str) and 1 <= len(obj["name"]) <= 8, obj
    assert type(obj["age"]) is int and 0 <= obj["age"] <= 120, obj
    assert type(obj["ok"]) is bool, obj
    if "tags" in obj:
        assert isinstance(obj["tags"], list) and len(obj["tags"]) <= 3 and set(obj["tags"]) <= {"a", "b", "c"}, obj
    if "point" in obj:
        assert obj["point"].keys() == {"x"} and type(obj["point"]["x"]) is int and -9 <= obj["point"]["x"] <= 9, obj


def allowed_ids(row: torch.Tensor, vocab: int) -> np.ndarray:
    """Token ids whose bit is set in one bitmask row (an independent unpacking, numpy's)."""
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[:vocab])


@pytest.fixture(scope="module")
def source():
    return open_model_source(None)


@pytest.fixture(scope="module")
def tokenizer(source) -> Tokenizer:
    return source.load_tokenizer()


@pytest.fixture(scope="module")
def compiler(source, tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, source.config.vocab_size, frozenset(source.config.eos_token_ids))


def walk(compiler: GrammarCompiler, spec: StructuredOutputsParams, gen: torch.Generator,
         cap: int) -> tuple[list[int], bool]:
    """A random walk through ``spec``'s grammar: (token ids before EOS, whether EOS came within ``cap`` tokens)."""
    vocab, eos = compiler.vocab_size, compiler.eos_token_ids
    state = compiler.new_state(spec)
    bitmask = new_bitmask(1, vocab)
    ids: list[int] = []
    for _ in range(cap + 1):
        state.fill_bitmask(bitmask, 0)
        allowed = allowed_ids(bitmask[0], vocab)
        assert len(allowed), f"nothing allowed after {ids}"
        if state.is_terminated:
            assert set(allowed.tolist()) == set(eos), "a complete grammar allows exactly the EOS ids"
        token = int(allowed[int(torch.randint(len(allowed), (1,), generator=gen))])
        assert state.accept(token), state.error
        if token in eos:
            return ids, True
        ids.append(token)
    return ids, False


# (name, spec, checker of the decoded text, walks, token cap); 200 walks in all.
WALKS = [
    # re.ASCII: \d means [0-9], as in vLLM's default backend (a Unicode \d would admit "७८९").
    ("regex_phone", StructuredOutputsParams(regex=PHONE), lambda s: re.fullmatch(PHONE, s, re.ASCII), 30, 32),
    ("regex_words", StructuredOutputsParams(regex=WORDS), lambda s: re.fullmatch(WORDS, s), 30, 64),
    ("choice", StructuredOutputsParams(choice=CHOICES), lambda s: s in CHOICES, 30, 32),
    ("json_schema", StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
     lambda s: check_person(json.loads(s)) is None, 50, 96),
    ("gbnf", StructuredOutputsParams(grammar=GBNF), lambda s: re.fullmatch(SENTENCE, s), 20, 32),
    ("lark", StructuredOutputsParams(grammar=LARK), lambda s: re.fullmatch(SENTENCE, s), 20, 32),
]


@pytest.mark.parametrize("name,spec,valid,walks,cap", WALKS, ids=[w[0] for w in WALKS])
def test_random_walks_satisfy_the_constraint(compiler, tokenizer, name, spec, valid, walks, cap):
    gen = torch.Generator().manual_seed(sum(map(ord, name)))
    for i in range(walks):
        ids, ended = walk(compiler, spec, gen, cap)
        text = tokenizer.decode(ids)
        assert ended, f"walk {i} of a bounded grammar did not end within {cap} tokens: {text!r}"
        assert valid(text), f"walk {i}: {text!r}"


def test_json_object_walks(compiler, tokenizer):
    """Any JSON object: open-ended, so a uniform walk rarely closes it; each one that does is an object."""
    gen = torch.Generator().manual_seed(7)
    ended_count = 0
    for _ in range(20):  # with the 180 above: 200 walks
        ids, ended = walk(compiler, StructuredOutputsParams(json_object=True, disable_any_whitespace=True), gen, 48)
        text = tokenizer.decode(ids)
        assert text.startswith("{"), text
        if ended:
            ended_count += 1
            assert isinstance(json.loads(text), dict), text
    assert ended_count >= 4


def test_compact_and_flexible_json_whitespace(compiler, tokenizer):
    """``disable_any_whitespace`` refuses whitespace between JSON tokens; the default allows it."""
    space = tokenizer.encode(" ", add_special_tokens=False)
    brace = tokenizer.encode("{", add_special_tokens=False)
    assert len(space) == len(brace) == 1
    for compact, space_allowed in ((True, False), (False, True)):
        state = compiler.new_state(StructuredOutputsParams(json=PERSON, disable_any_whitespace=compact))
        bitmask = new_bitmask(1, compiler.vocab_size)
        assert state.accept(brace[0])
        state.fill_bitmask(bitmask, 0)
        assert (space[0] in allowed_ids(bitmask[0], compiler.vocab_size)) == space_allowed


def test_refused_token_and_termination(compiler, tokenizer):
    state = compiler.new_state(StructuredOutputsParams(regex=PHONE))
    bitmask = new_bitmask(1, compiler.vocab_size)
    for token in tokenizer.encode("555-0199", add_special_tokens=False):
        assert not state.is_terminated
        state.fill_bitmask(bitmask, 0)
        assert token in allowed_ids(bitmask[0], compiler.vocab_size)
        assert state.accept(token)
    assert state.is_terminated and state.error is None
    state.fill_bitmask(bitmask, 0)
    assert set(allowed_ids(bitmask[0], compiler.vocab_size).tolist()) == set(compiler.eos_token_ids)
    assert state.accept(min(compiler.eos_token_ids))

    refused = compiler.new_state(StructuredOutputsParams(regex=PHONE))
    letter = tokenizer.encode("a", add_special_tokens=False)[0]
    assert not refused.accept(letter)
    assert refused.error and refused.is_terminated
    refused.fill_bitmask(bitmask, 0)  # a refused state only lets the sequence stop
    assert set(allowed_ids(bitmask[0], compiler.vocab_size).tolist()) == set(compiler.eos_token_ids)
    assert not compiler.new_state(StructuredOutputsParams(regex=PHONE)).accept(-1)


def test_special_tokens_are_never_allowed(compiler):
    """Only text the grammar admits: ``.*`` allows EOS (the end) but no other special token."""
    state = compiler.new_state(StructuredOutputsParams(regex=".*"))
    bitmask = new_bitmask(1, compiler.vocab_size)
    state.fill_bitmask(bitmask, 0)
    allowed = set(allowed_ids(bitmask[0], compiler.vocab_size).tolist())
    assert set(compiler.eos_token_ids) <= allowed
    assert 1 not in allowed  # <|im_start|>
    assert len(allowed) > 40000


@pytest.mark.parametrize("extra", [77, 96])
def test_padding_vocab_rows_are_never_allowed(tokenizer, extra):
    """Logits wider than the tokenizer (padded embeddings): no bit at or past len(tokenizer) is ever set."""
    vocab = len(tokenizer) + extra
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    gen = torch.Generator().manual_seed(extra)
    for spec in (StructuredOutputsParams(regex=".{0,40}"), StructuredOutputsParams(json_object=True)):
        state = compiler.new_state(spec)
        bitmask = new_bitmask(1, vocab)
        for _ in range(40):
            state.fill_bitmask(bitmask, 0)
            bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder="little")
            assert not bits[len(tokenizer):].any()
            allowed = np.flatnonzero(bits)
            token = int(allowed[int(torch.randint(len(allowed), (1,), generator=gen))])
            assert state.accept(token)
            if state.is_terminated:
                break


@pytest.mark.parametrize("fewer", [45, 10])  # one word fewer than the tokenizer's mask; the same words
def test_tokenizer_wider_than_the_logits(tokenizer, fewer):
    """Tokens past the logits' width (tokenizer-only added tokens) are cut from the mask, tail bits cleared."""
    vocab = len(tokenizer) - fewer
    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    state = compiler.new_state(StructuredOutputsParams(regex=".*"))
    bitmask = new_bitmask(2, vocab)
    state.fill_bitmask(bitmask, 1)
    bits = np.unpackbits(bitmask[1].numpy().view(np.uint8), bitorder="little")
    assert not bits[vocab:].any() and bits[:vocab].sum() > 40000
    assert (bitmask[0] == -1).all()  # other rows untouched
    compiler.fill_bitmasks([state], bitmask, [0])
    assert torch.equal(bitmask[0], bitmask[1])


def test_hf_folder_tokenizer_gives_the_same_masks(tmp_path, tokenizer, compiler):
    """A HF-folder tokenizer (saved from the GGUF one) builds the same masks along a walk."""
    from transformers import AutoTokenizer

    tokenizer.hf_tokenizer.save_pretrained(tmp_path)
    hf_tok = Tokenizer(AutoTokenizer.from_pretrained(tmp_path), eos_token_ids=sorted(compiler.eos_token_ids))
    other = GrammarCompiler(hf_tok, compiler.vocab_size, compiler.eos_token_ids)
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    a, b = compiler.new_state(spec), other.new_state(spec)
    masks = new_bitmask(2, compiler.vocab_size)
    gen = torch.Generator().manual_seed(3)
    for _ in range(30):
        a.fill_bitmask(masks, 0)
        b.fill_bitmask(masks, 1)
        assert torch.equal(masks[0], masks[1])
        allowed = allowed_ids(masks[0], compiler.vocab_size)
        token = int(allowed[int(torch.randint(len(allowed), (1,), generator=gen))])
        assert a.accept(token) and b.accept(token)
        if a.is_terminated:
            break


def test_byte_level_tokenizer_with_a_sentencepiece_style_decoder(tokenizer, compiler):
    """transformers 5.17 builds the default model's GGUF tokenizer with the decoder ByteFallback, Fuse,
    Replace("▁"), ByteLevel (it decodes right); llguidance read ``Ġsplit`` as ``Äsplit`` from it and refused
    tokens its own masks allowed. Same masks and walks as with the plain decoder."""
    import copy

    from tokenizers import decoders

    hf = copy.deepcopy(tokenizer.hf_tokenizer)
    hf.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                                      decoders.Replace("▁", " "), decoders.ByteLevel()])
    other = GrammarCompiler(Tokenizer(hf, eos_token_ids=sorted(compiler.eos_token_ids)), compiler.vocab_size,
                            compiler.eos_token_ids)
    for spec, text in ((StructuredOutputsParams(choice=CHOICES), "banana split"),
                       (StructuredOutputsParams(grammar=GBNF), "Alice likes.")):
        a, b = compiler.new_state(spec), other.new_state(spec)
        masks = new_bitmask(2, compiler.vocab_size)
        for token in tokenizer.encode(text, add_special_tokens=False):
            a.fill_bitmask(masks, 0)
            b.fill_bitmask(masks, 1)
            assert torch.equal(masks[0], masks[1]), text
            assert b.accept(token), b.error
            a.accept(token)
        assert b.is_terminated


def test_fill_bitmasks_matches_one_by_one(compiler, tokenizer):
    specs = [StructuredOutputsParams(regex=PHONE), StructuredOutputsParams(choice=CHOICES),
             StructuredOutputsParams(json=PERSON, disable_any_whitespace=True),
             StructuredOutputsParams(grammar=GBNF)]
    states = [compiler.new_state(s) for s in specs]
    prefixes = ["55", "ba", '{"name":"', "Alice "]
    for state, prefix in zip(states, prefixes):
        for token in tokenizer.encode(prefix, add_special_tokens=False):
            assert state.accept(token), prefix
    rows = [4, 0, 2, 5]
    together, alone = new_bitmask(6, compiler.vocab_size), new_bitmask(6, compiler.vocab_size)
    together[1] = 12345
    alone[1] = 12345
    compiler.fill_bitmasks(states, together, rows)
    for state, row in zip(states, rows):
        state.fill_bitmask(alone, row)
    assert torch.equal(together, alone)
    assert (together[3] == -1).all() and (together[1] == 12345).all()


def test_accept_later_advances_with_the_next_masks(compiler, tokenizer):
    """Tokens handed over with ``accept_later`` (the engine's way) give the same masks as ``accept``, all rows
    advanced in one batch; a refused one leaves only EOS and says why."""
    specs = [StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), StructuredOutputsParams(choice=CHOICES),
             StructuredOutputsParams(grammar=GBNF), StructuredOutputsParams(regex=PHONE)]
    now, later = [compiler.new_state(s) for s in specs], [compiler.new_state(s) for s in specs]
    texts = ['{"name":"Al', "banana s", "Alice l", "55x"]  # "x" is refused by the phone regex
    tokens = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    masks_now, masks_later = new_bitmask(4, compiler.vocab_size), new_bitmask(4, compiler.vocab_size)
    for step in range(max(map(len, tokens))):
        for i, ids in enumerate(tokens):
            if step < len(ids):
                now[i].accept(ids[step])
                later[i].accept_later(ids[step])
        for i, state in enumerate(now):
            state.fill_bitmask(masks_now, i)
        compiler.fill_bitmasks(later, masks_later)
        assert torch.equal(masks_now, masks_later), step
    assert later[3].error and later[3].is_terminated and not later[0].is_terminated
    assert set(allowed_ids(masks_later[3], compiler.vocab_size).tolist()) == set(compiler.eos_token_ids)


def test_fill_later_matches_fill_bitmasks_and_its_thread_ends_at_close(source, tokenizer, monkeypatch):
    """Masks filled on the compiler's thread (the engine's way) equal the same step filled in the caller's
    thread; a fill that fails re-raises where it is awaited; ``close`` joins the thread and refuses more."""
    others = set(threading.enumerate())  # other engines' compilers may have their threads
    compiler = GrammarCompiler(tokenizer, source.config.vocab_size, frozenset(source.config.eos_token_ids))
    specs = [StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), StructuredOutputsParams(regex=PHONE),
             StructuredOutputsParams(choice=CHOICES)]
    later, here = [compiler.new_state(s) for s in specs], [compiler.new_state(s) for s in specs]
    texts = ['{"name":"Alice","age":3', "555-01", "banana s"]
    tokens = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    for step in range(max(map(len, tokens))):
        for i, ids in enumerate(tokens):
            if step < len(ids):
                later[i].accept_later(ids[step])
                here[i].accept_later(ids[step])
        pending = compiler.fill_later(later)
        expected = new_bitmask(len(here), compiler.vocab_size)
        compiler.fill_bitmasks(here, expected)
        assert torch.equal(pending.wait(), expected), step
    workers = [t for t in set(threading.enumerate()) - others if t.name.startswith("tidyrun-grammar-masks")]
    assert len(workers) == 1  # this compiler's
    def broken_job(*args):
        def boom():
            raise OSError("the library failed")
        return boom

    monkeypatch.setattr(compiler._backend, "fill_job", broken_job)
    with pytest.raises(OSError, match="the library failed"):
        compiler.fill_later(later).wait()
    compiler.close()
    compiler.close()
    assert not workers[0].is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        compiler.fill_later(later)


def test_fill_ahead_rows_serve_the_states_unchanged_since(source, tokenizer, monkeypatch):
    """Masks started ahead (the engine's, right after a step) serve the next ``fill_later`` for the states
    that took no token since, in any order; states new or changed since are filled then; the result equals
    filling every row now."""
    compiler = GrammarCompiler(tokenizer, source.config.vocab_size, frozenset(source.config.eos_token_ids))
    specs = [StructuredOutputsParams(json=PERSON, disable_any_whitespace=True), StructuredOutputsParams(regex=PHONE),
             StructuredOutputsParams(choice=CHOICES), StructuredOutputsParams(grammar=GBNF)]
    texts = ['{"name":"Al', "555-0", "ba", "Alice "]
    ours, reference = ([compiler.new_state(s) for s in specs] for _ in range(2))
    for states in (ours, reference):
        for state, text in zip(states, texts):
            for token in tokenizer.encode(text, add_special_tokens=False):
                state.accept_later(token)
    filled = []
    fill_job = compiler._backend.fill_job
    monkeypatch.setattr(compiler._backend, "fill_job", lambda states, *rest: (filled.append(len(states)),
                                                                               fill_job(states, *rest))[1])
    a, b, c, d = ours
    compiler.fill_ahead([a, b, c])
    compiler.drain()
    letter = tokenizer.encode("i", add_special_tokens=False)[0]
    a.accept_later(letter)  # changed since: filled again
    reference[0].accept_later(letter)
    masks = compiler.fill_later([c, d, a]).wait()
    expected = new_bitmask(3, compiler.vocab_size)
    compiler.fill_bitmasks([reference[2], reference[3], reference[0]], expected)
    assert torch.equal(masks, expected)
    assert filled == [3, 2, 3]  # ahead: a, b, c; then only d and a; then the reference's three
    again = compiler.fill_later([c, d, a]).wait()  # the fill ahead serves one step only
    assert torch.equal(again, expected) and filled[-1] == 3
    compiler.close()


def test_process_logits_refuses_masks_of_other_rows(compiler, tokenizer):
    """Masks started for other sequences than the batch's grammar rows are a bug, said as one (the fill is
    awaited first, so the states are free again); the right ones mask each row to its grammar."""
    from tidyrun.logits_process import process_logits
    from tidyrun.sequence import Sequence

    params = SamplingParams(structured_outputs=StructuredOutputsParams(regex=PHONE))
    seqs = [Sequence(i, f"r{i}", 0, [1, 2, 3], params, tokenizer, None,
                     grammar=compiler.new_state(params.structured_outputs)) for i in range(2)]
    masks = compiler.fill_later([seqs[1].grammar, seqs[0].grammar])
    with pytest.raises(RuntimeError, match="not those of this batch"):
        process_logits(torch.zeros(2, compiler.vocab_size), seqs, compiler.eos_token_ids, masks)
    logits = torch.zeros(2, compiler.vocab_size)
    process_logits(logits, seqs, compiler.eos_token_ids, compiler.fill_later([s.grammar for s in seqs]))
    expected = new_bitmask(1, compiler.vocab_size)
    compiler.new_state(params.structured_outputs).fill_bitmask(expected, 0)
    for row in logits:
        assert torch.isfinite(row).nonzero()[:, 0].tolist() == allowed_ids(expected[0], compiler.vocab_size).tolist()


def test_one_character_strings_stay_json(compiler, tokenizer):
    """Strings of at most one character, alone and in an array, stay JSON (xgrammar admitted a raw tab there)."""
    schema = {"type": "object", "properties": {"c": {"type": "string", "maxLength": 1},
                                               "l": {"type": "array", "items": {"type": "string", "maxLength": 1},
                                                     "maxItems": 2}},
              "required": ["c", "l"], "additionalProperties": False}
    spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    gen = torch.Generator().manual_seed(11)
    ended = 0
    for _ in range(40):
        ids, done = walk(compiler, spec, gen, 40)
        if done:
            ended += 1
            obj = json.loads(tokenizer.decode(ids))
            assert len(obj["c"]) <= 1 and all(len(x) <= 1 for x in obj["l"]), obj
    assert ended >= 20


def test_complete_json_allows_only_eos(compiler, tokenizer):
    """A closed object can only stop: ``is_terminated`` before EOS, and the engine's EOS then ends it."""
    state = compiler.new_state(StructuredOutputsParams(json=PERSON, disable_any_whitespace=True))
    for token in tokenizer.encode('{"name":"A","age":3,"ok":true}', add_special_tokens=False):
        assert not state.is_terminated
        assert state.accept(token)
    assert state.is_terminated and state.error is None
    mask = new_bitmask(1, compiler.vocab_size)
    state.fill_bitmask(mask, 0)
    assert set(allowed_ids(mask[0], compiler.vocab_size).tolist()) == set(compiler.eos_token_ids)
    assert state.accept(min(compiler.eos_token_ids)) and state.is_terminated


def test_sequences_of_one_grammar_spread_over_independent_templates(source, tokenizer):
    """Sequences of one grammar are dealt over separately built templates (so llguidance can fill their
    masks in parallel) and every lane gives the same masks after the same tokens."""
    lanes = 3
    compiler = GrammarCompiler(tokenizer, source.config.vocab_size, frozenset(source.config.eos_token_ids), lanes=lanes)
    spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
    states = [compiler.new_state(spec) for _ in range(lanes + 2)]
    compiled = compiler.compile(spec)
    assert len(compiled._templates) == lanes
    for state in states:
        for token in tokenizer.encode('{"name":"Bo', add_special_tokens=False):
            assert state.accept(token)
    masks = new_bitmask(len(states), compiler.vocab_size, allow_all=False)
    compiler.fill_bitmasks(states, masks)
    assert (masks == masks[0]).all()
    one = new_bitmask(1, compiler.vocab_size)
    states[0].fill_bitmask(one, 0)
    assert torch.equal(one[0], masks[0]) and not (one == -1).all()


INVALID = [
    (StructuredOutputsParams(json="{not json"), "not valid JSON"),
    (StructuredOutputsParams(json="[1, 2]"), "must be a JSON object"),
    (StructuredOutputsParams(json={"type": "foo"}), "foo"),
    (StructuredOutputsParams(json={"enum": {1, 2}}), "not serializable"),
    (StructuredOutputsParams(json={"type": "object", "properties": {"a": {"$ref": "#/missing"}}}), "missing"),
    (StructuredOutputsParams(json={"type": "string", "pattern": "("}), "unclosed group"),
    (StructuredOutputsParams(regex="("), "unclosed group"),
    (StructuredOutputsParams(regex="a{5,2}"), "repetition"),
    (StructuredOutputsParams(regex="(?=a)b"), "look-around"),
    (StructuredOutputsParams(grammar="root ::= foo"), "foo"),
    (StructuredOutputsParams(grammar="start: /[/"), "unclosed character class"),
]


@pytest.mark.parametrize("spec,detail", INVALID, ids=[f"{s.kind}-{i}" for i, (s, _) in enumerate(INVALID)])
def test_invalid_constraints_raise_invalid_request(compiler, spec, detail):
    kind = {"json": "JSON schema", "regex": "regex", "grammar": "grammar"}[spec.kind]
    with pytest.raises(InvalidRequestError, match=f"structured outputs: invalid {kind}") as info:
        compiler.compile(spec)
    assert detail in str(info.value)
    assert str(info.value).count("structured outputs:") == 1, str(info.value)  # said once, not wrapped twice


def test_compile_cache_is_per_spec_and_bounded(compiler):
    first = compiler.compile(StructuredOutputsParams(regex=r"[ab]{2}"))
    assert compiler.compile(StructuredOutputsParams(regex=r"[ab]{2}")) is first  # equal spec, another object
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    ordered = compiler.compile(StructuredOutputsParams(json=schema))
    reordered = compiler.compile(StructuredOutputsParams(json=dict(reversed(schema.items()))))
    assert compiler.compile(StructuredOutputsParams(json=json.dumps(schema))) is ordered  # the same schema as text
    assert compiler.compile(StructuredOutputsParams(json=schema, disable_any_whitespace=True)) is not ordered
    assert reordered is not ordered
    for i in range(200):
        compiler.compile(StructuredOutputsParams(regex=f"x{i}"))
    assert compiler.compile(StructuredOutputsParams(regex=r"[ab]{2}")) is not first  # evicted


def test_disable_additional_properties_closes_objects(compiler, tokenizer):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    comma = tokenizer.encode(",", add_special_tokens=False)[0]
    for closed in (False, True):
        spec = StructuredOutputsParams(json=schema, disable_any_whitespace=True, disable_additional_properties=closed)
        state = compiler.new_state(spec)
        for token in tokenizer.encode('{"a":1', add_special_tokens=False):
            assert state.accept(token)
        bitmask = new_bitmask(1, compiler.vocab_size)
        state.fill_bitmask(bitmask, 0)
        assert (comma in allowed_ids(bitmask[0], compiler.vocab_size)) == (not closed)
    assert "additionalProperties" not in schema  # the caller's schema is not changed


def test_bitmask_checks_its_shape(compiler):
    state = compiler.new_state(StructuredOutputsParams(regex=PHONE))
    with pytest.raises(ValueError, match="bitmask"):
        state.fill_bitmask(new_bitmask(1, compiler.vocab_size + 64), 0)
    with pytest.raises(ValueError, match="bitmask"):
        state.fill_bitmask(new_bitmask(1, compiler.vocab_size).to(torch.int64), 0)
    with pytest.raises(IndexError):
        state.fill_bitmask(new_bitmask(1, compiler.vocab_size), 1)


def naive_apply(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None) -> torch.Tensor:
    out = logits.clone()
    rows = list(range(logits.shape[0])) if rows is None else rows
    for i, row in enumerate(rows):
        for t in range(logits.shape[1]):
            word = int(bitmask[i, t // 32]) & 0xFFFFFFFF
            if not (word >> (t % 32)) & 1:
                out[row, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab", [100, 128, 33])
@pytest.mark.parametrize("rows", [None, [5, 1, 3], []])
def test_apply_bitmask_matches_a_naive_reference(vocab, rows):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(7, vocab, generator=gen)
    count = 7 if rows is None else len(rows)
    bitmask = torch.randint(-2**31, 2**31 - 1, (count, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
    if count:
        bitmask[0, 0] = -1  # all allowed, and the sign bit on its own
        bitmask[-1, -1] = -2**31
    expected = naive_apply(logits, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(logits, expected)


def test_apply_bitmask_checks_its_arguments():
    logits = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="words"):
        apply_bitmask(logits, new_bitmask(3, 100))
    with pytest.raises(ValueError, match="rows"):
        apply_bitmask(logits, new_bitmask(2, 64))
    with pytest.raises(ValueError, match="distinct"):
        apply_bitmask(logits, new_bitmask(2, 64), rows=[1, 1])
    with pytest.raises(ValueError, match="distinct"):
        apply_bitmask(logits, new_bitmask(1, 64), rows=[3])


@pytest.mark.gpu
def test_apply_bitmask_on_cuda_matches_cpu():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50000, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (40, (50000 + 31) // 32), generator=gen, dtype=torch.int32)
    rows = list(range(0, 64, 3))[:20] + list(range(1, 64, 3))[:20]
    on_gpu = logits.cuda()
    apply_bitmask(on_gpu, bitmask, rows)
    apply_bitmask(logits, bitmask, rows)
    assert torch.equal(on_gpu.cpu(), logits)


# -- through the engine -------------------------------------------------------------------

E2E_NAMES = ["Ann", "Bob", "Eve"]
E2E_SCHEMA = {  # bounded and short: at most 38 characters, ~15 tokens as a model writes it
    "type": "object",
    "properties": {"name": {"enum": E2E_NAMES},
                   "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "student": {"type": "boolean"}},
    "required": ["name", "age", "student"],
    "additionalProperties": False,
}
E2E_CHOICES = ["red", "green", "blue", "light yellow"]


def e2e_check_json(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return (isinstance(obj, dict) and obj.keys() == {"name", "age", "student"} and obj["name"] in E2E_NAMES
            and type(obj["age"]) is int and 0 <= obj["age"] <= 99 and type(obj["student"]) is bool)


def test_engine_fills_each_step_masks_once():
    """The engine starts a step's masks right after the previous step (``fill_ahead``) and the step takes
    them: every sampled token's mask is filled once (twice would mean the fill ahead is thrown away)."""
    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    filled = []
    try:
        backend = llm._grammars._backend
        fill_job = backend.fill_job
        backend.fill_job = lambda states, *rest: (filled.append(len(states)), fill_job(states, *rest))[1]
        spec = StructuredOutputsParams(json=PERSON, disable_any_whitespace=True)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=40, structured_outputs=spec) for i in range(4)]
        outputs = llm.generate(["A person as JSON: "] * 4, params, use_tqdm=False)
    finally:
        llm.shutdown()
    for o in outputs:
        check_person(json.loads(o.outputs[0].text))
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    # One mask per sampled token, plus at most one ahead per request left unused after its last token.
    assert tokens <= sum(filled) <= tokens + len(outputs), (filled, tokens)


def test_engine_generates_only_valid_structured_outputs():
    """200 sampled requests (temperature 1) over regex / JSON schema / choice, in one generate call."""
    kinds = [
        ("My phone number is ", StructuredOutputsParams(regex=PHONE), lambda s: re.fullmatch(PHONE, s, re.ASCII)),
        ("Describe a student as JSON: ", StructuredOutputsParams(json=E2E_SCHEMA, disable_any_whitespace=True),
         e2e_check_json),
        ("My favourite colour is ", StructuredOutputsParams(choice=E2E_CHOICES), lambda s: s in E2E_CHOICES),
    ]
    prompts, params, checks = [], [], []
    for i in range(200):
        prompt, spec, check = kinds[i % 3]
        prompts.append(prompt)
        params.append(SamplingParams(temperature=1.0, seed=i, max_tokens=64, structured_outputs=spec))
        checks.append(check)
    others = set(threading.enumerate())
    llm = LLM(dtype="float32", device="cpu", max_model_len=512)
    try:
        # One request first, so an engine that ignores the constraint fails in seconds, not after 200 generations.
        [probe] = llm.generate([kinds[2][0]], params[2], use_tqdm=False)
        assert probe.outputs[0].text in E2E_CHOICES and probe.outputs[0].finish_reason == "stop", probe.outputs[0]
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        mask_threads = [t for t in set(threading.enumerate()) - others if t.name.startswith("tidyrun-grammar-masks")]
        assert mask_threads  # the engine filled its masks on its compiler's thread
    finally:
        llm.shutdown()
    assert not any(t.is_alive() for t in mask_threads)  # shutdown joined it
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n200 structured requests: {elapsed:.1f} s, {tokens} tokens")
    bad = [(o.outputs[0].text, o.outputs[0].finish_reason) for o, check in zip(outputs, checks)
           if o.outputs[0].finish_reason != "stop" or not check(o.outputs[0].text)]
    assert not bad, bad[:10]
    assert len({o.outputs[0].text for o in outputs}) > 20  # sampled, not one answer repeated
