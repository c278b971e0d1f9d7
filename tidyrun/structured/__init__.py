r"""Structured outputs: a grammar per request, turned into a token mask on the logits.

Two maintained grammar libraries from PyPI, chosen per request
(``compiler.GrammarCompiler`` says how; vLLM's ``backend`` names):
xgrammar for JSON schemas, regexes and choices, llguidance for Lark / GBNF
grammars and what xgrammar does not enforce. Measured on the default
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
64 rows' masks of a 3-field schema     13.1 ms              1.1 ms
  (maxLength 24), 2 threads, a step
64 rows' advances, a step              0.51 ms              0.44 ms
=====================================  ===================  =====================

Why both: xgrammar's masks are what a step needs (the 64-row fill of a
realistic schema is 12x cheaper, and on the GPU it must hide behind the
forward pass), but it compiles some grammars slowly (counted repetitions
expand into rules), silently ignores some JSON Schema keywords, and reads no
Lark; llguidance compiles anything in milliseconds and covers more of JSON
Schema. The mask is a host int32 bitmask (bit ``t % 32`` of word ``t // 32``
set = token ``t`` allowed), filled per sequence on the host and applied to
the logits on their device with one copy (``apply_bitmask``).
"""

from .compiler import GrammarCompiler
from .mask import apply_bitmask, new_bitmask
from .state import GrammarState

__all__ = ["GrammarCompiler", "GrammarState", "apply_bitmask", "new_bitmask"]
