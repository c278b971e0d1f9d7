"""Programmatic dependent launch (PDL, Hopper and later): a kernel's launch overlaps the end of the one before.

Why: a decode step is a chain of ~150 short kernels (norm, products, RoPE, attention, ...); between two of them
the GPU drains the first grid, flushes its writes and only then launches the next one. Profiled on the H200,
batch 1: ~86 us of such gaps inside the graphs of a ~1.1 ms step (docs/BENCHMARKS.md). Launched with PDL, the
next grid is launched once every program of the current one has exited (the implicit trigger), without waiting
for the grid's completion, and its programs wait at ``griddepcontrol.wait`` until the current grid has finished
and its writes are visible. CUDA graphs keep it (programmatic edges).

Measured on the H100 (docs/BENCHMARKS.md, trees alternated): the batch-1 decode step 1.28 against 1.30-1.31 ms,
16 and 64 rows unchanged. An explicit trigger (``gdc_launch_dependents`` as each program passes its wait, so the
next grid's programs sit waiting beside the running ones) gained no more at batch 1 and cost 5% at 16 rows; with
the products also asking for their weight lines in L2 while they waited, 1-16 rows cost 13-19% more. So the
trigger stays implicit.

Rule that keeps it correct: a kernel launched with ``launch_pdl`` calls ``pdl_prologue`` before it touches
memory, so it reads nothing and overwrites nothing before the kernel ahead of it is complete. That wait is
transitive: every kernel before it finished earlier. Off (``PDL=False``), nothing is emitted.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait until the kernel ahead has finished and its writes are visible (PDL); nothing without it."""
    if PDL:
        tl.extra.cuda.gdc_wait()


def pdl_args(pdl: bool) -> dict:
    """The launch keywords of a kernel that takes ``PDL`` and calls ``pdl_prologue``: the constexpr and, with
    PDL, the launch option (never passed without it: the interpreter and older GPUs do not know it)."""
    return {"PDL": True, "launch_pdl": True} if pdl else {"PDL": False}
