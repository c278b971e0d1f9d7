"""Programmatic dependent launch (PDL, Hopper and later): a kernel's programs are placed on the SMs while the
kernel before it in the stream still runs, and wait there for it.

Why: a decode step is a chain of ~150 short kernels (norm, products, RoPE, attention, ...); between two of them
the GPU drains the first grid, flushes its writes and only then launches and places the next one's programs.
Profiled on the H200, batch 1: ~86 us of such gaps inside the graphs of a ~1.1 ms step (docs/BENCHMARKS.md).
With PDL the next grid is launched as soon as every program of the current one has started, and its programs
wait at ``griddepcontrol.wait`` until the current grid has finished and its writes are visible: the launch
and placement overlap the tail of the kernel before. CUDA graphs keep the overlap (programmatic edges).

Rule that keeps it correct: a kernel launched with ``launch_pdl`` calls ``pdl_prologue`` before it touches
memory, so it reads nothing and overwrites nothing before the kernel ahead of it is complete. That wait is
transitive: every kernel before it finished earlier. Off (``PDL=False``), nothing is emitted.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait for the kernel ahead (PDL), then let the next one be launched: its programs only wait here."""
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def pdl_launch(pdl: bool) -> dict:
    """The launch options of a kernel that calls ``pdl_prologue`` (none without PDL: the interpreter and
    older GPUs never see the option)."""
    return {"launch_pdl": True} if pdl else {}

