r"""Structured outputs: a grammar per request, turned into a token mask on the logits.

The grammar library is llguidance. Both candidates were measured on the
default model's tokenizer (SmolLM2-135M, vocab 49152), first on 2 shared CPU
cores with random walks that draw uniformly among the allowed tokens:

=====================================  ===================  =====================
                                       llguidance 1.9.1     xgrammar 0.2.9
=====================================  ===================  =====================
install (beyond torch, transformers)   3 MB abi3 wheel,     1.3 MB wheel +
                                       no dependencies      apache-tvm-ffi (3.3 MB)
                                                            + pydantic + triton
tokenizer info                         850-1080 ms          250-340 ms
compile: JSON schema, 3 fields         1.4 ms               13-47 ms
compile: regex [a-z]{1,200}@[a-z]...   6 ms                 450-998 ms
mask, one matcher                      20-110 us; 300-1000  5-70 us
                                       us inside a string
                                       with maxLength 24
64 rows' masks, 3-field schema with    17.6 ms              0.98 ms
  maxLength 24, 2 threads, a step
=====================================  ===================  =====================

and then end to end, on the H200 (2026-12-05, branch ``xgrammar-backend``,
docs/BENCHMARKS.md): xgrammar's cheaper masks did not make constrained
decoding faster. 64 requests under that schema, per output token, same run:
1.2B shape 119-129 us (xgrammar) against 134-135 us (llguidance), default
model 162-174 against 134-157 us; but xgrammar lets forced text such as
``{"name":"`` be written in more, smaller tokens, so the same requests took
1831 tokens against 1461 (1644 against 1438): 19-38% more time per request.
Random walks also found xgrammar 0.2.9 silently not enforcing much of JSON
Schema (``allOf``, ``not``, ``pattern`` beside ``minLength``, ``$ref``
beside other keywords, ``multipleOf`` on numbers, ...), admitting raw control
characters in length-bounded strings and special tokens as text, and reading
``.`` as matching a newline; llguidance enforces a keyword or refuses it by
name. So tidyrun keeps one dependency-free library; the branch keeps the
xgrammar backend and its tests.

The mask is a host int32 bitmask (bit ``t % 32`` of word ``t // 32`` set =
token ``t`` allowed), filled per sequence on the host and copied to the
logits' device once per step: a step whose grammar rows have nothing else to
process samples with one race that reads the words itself
(``kernels/race.py``, ``ModelRunner._masked_race``); the others set refused
tokens' logits to -inf first (``apply_bitmask``).
"""

from .compiler import GrammarCompiler, PendingMasks
from .mask import apply_bitmask, new_bitmask
from .state import GrammarState

__all__ = ("GrammarCompiler", "GrammarState", "PendingMasks", "apply_bitmask", "new_bitmask")
