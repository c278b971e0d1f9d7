r"""Structured outputs: a grammar per request, turned into a token mask on the logits.

Two maintained grammar libraries from PyPI, chosen per request
(``compiler.GrammarCompiler`` says how; vLLM's ``backend`` names):
xgrammar for plain JSON schemas (``xgr.enforces`` says which) and choices,
llguidance for regexes, Lark / GBNF grammars and every schema xgrammar does
not enforce. Measured on the default
model's tokenizer (SmolLM2-135M, vocab 49152) on 2 shared CPU cores:

=====================================  ===================  =====================
                                       llguidance 1.9.1     xgrammar 0.2.9
=====================================  ===================  =====================
install (beyond torch, transformers)   3 MB abi3 wheel,     1.3 MB wheel +
                                       no dependencies      apache-tvm-ffi (3.3 MB)
                                                            + pydantic + triton
                                                            (torch's CUDA builds
                                                            bring triton anyway)
tokenizer info                         850-1080 ms          250-340 ms
compile: JSON schema, 3 fields         1.4 ms               13-47 ms
compile: regex \d{3}-\d{4}             2.4 ms               0.2-48 ms
compile: regex [a-z]{1,200}@[a-z]...   6 ms                 450-998 ms
compile: choice (4 strings)            2.0 ms               0.8 ms
mask, one matcher, random walks        20-110 us;           5-70 us
                                       300-1000 us inside
                                       a string with
                                       maxLength 24
64 rows' masks, one step:              ``bench/grammar_masks.py`` (the engine's path, 2 threads)
  3-field schema, maxLength 24         17.6 ms              0.98 ms
  3-field schema, unbounded strings    1.05 ms              1.42 ms
  regex, choice                        1.8, 4.0 ms          0.64, 0.66 ms
64 rows' advances, one step            0.5-3.5 ms           0.4-0.5 ms
=====================================  ===================  =====================

Why both: xgrammar's masks are what a step needs (the 64-row fill of a
schema with bounded strings is 18x cheaper, and on the GPU it must hide
behind the forward pass), but it compiles some grammars slowly (counted
repetitions expand into rules), silently fails to enforce much of JSON
Schema (``xgr.py`` lists what random walks broke), reads regexes differently
(``.`` matches a newline) and splits forced text into more tokens (24
sampled JSON answers of the default model: 554 tokens against 527 for the
same kind of text); llguidance compiles anything in milliseconds, enforces
or refuses by name every keyword, and reads the Lark grammars vLLM's
guidance backend reads. The mask is a host int32 bitmask (bit ``t % 32`` of word ``t // 32``
set = token ``t`` allowed), filled per sequence on the host and applied to
the logits on their device with one copy (``apply_bitmask``).
"""

from .compiler import GrammarCompiler
from .mask import apply_bitmask, new_bitmask
from .state import GrammarState

__all__ = ("GrammarCompiler", "GrammarState", "apply_bitmask", "new_bitmask")
