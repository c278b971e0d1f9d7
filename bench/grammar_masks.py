"""What each grammar library costs per step on the host: 64 rows' masks and advances, and compile times.

    python bench/grammar_masks.py [--rows 64] [--steps 60] [--threads 2] [--json bench/results/grammar_masks.json]

Both libraries in one run, through tidyrun's own ``GrammarCompiler`` (the
path the engine takes), on the default model's tokenizer (its real 49k
vocabulary). ``--rows`` sequences per constraint walk in lockstep: each step
fills every row's mask at once (``fill_bitmasks``, the libraries' thread
pools of ``--threads``), then each row draws uniformly (seeded) among its
allowed tokens and hands it over with ``accept_later``; the next step's
``advance`` is timed apart from the fill. A row whose walk ends starts again
on a fresh state. Medians over ``--steps`` steps; compile times are the
first compile of each constraint (tidyrun's cache then serves repeats).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np
import torch

from tidyrun import StructuredOutputsParams
from tidyrun.loader import open_model_source
from tidyrun.structured import GrammarCompiler, new_bitmask

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}
CONSTRAINTS = {
    "json schema, 3 fields (maxLength 24)": StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True),
    "json schema, unbounded strings": StructuredOutputsParams(json={
        **SCHEMA, "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}}},
        disable_any_whitespace=True),
    "regex phone + word": StructuredOutputsParams(regex=r"\d{3}-\d{4} [A-Z][a-z]{2,12}"),
    "choice (4 strings)": StructuredOutputsParams(choice=["positive", "negative", "neutral", "mixed feelings"]),
}


def walk_steps(compiler: GrammarCompiler, spec: StructuredOutputsParams, rows: int, steps: int) -> dict:
    vocab = compiler.vocab_size
    eos = compiler.eos_token_ids
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    compiler.compile(spec)
    compile_s = time.perf_counter() - start
    states = [compiler.new_state(spec) for _ in range(rows)]
    bitmask = new_bitmask(rows, vocab, allow_all=False)
    fills, advances = [], []
    for _ in range(steps):
        start = time.perf_counter()
        compiler.advance(states)
        advances.append(time.perf_counter() - start)
        start = time.perf_counter()
        compiler.fill_bitmasks(states, bitmask)
        fills.append(time.perf_counter() - start)
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        for i in range(rows):
            allowed = np.flatnonzero(bits[i])
            token = int(rng.choice(allowed))
            if token in eos or states[i].is_terminated:
                states[i] = compiler.new_state(spec)
            else:
                states[i].accept_later(token)
    return dict(compile_ms=compile_s * 1e3, fill_ms=statistics.median(fills) * 1e3,
                advance_ms=statistics.median(advances) * 1e3, backend=compiler.compile(spec).backend)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--threads", type=int, default=None, help="the libraries' pools (default: 80%% of the cores)")
    ap.add_argument("--json", default="bench/results/grammar_masks.json")
    args = ap.parse_args()
    source = open_model_source(None)
    tokenizer = source.load_tokenizer()
    results = []
    for name, spec in CONSTRAINTS.items():
        row = {"constraint": name}
        for backend in ("xgrammar", "guidance"):
            compiler = GrammarCompiler(tokenizer, source.config.vocab_size, frozenset(source.config.eos_token_ids),
                                       threads=args.threads)  # a fresh one per side: no cache carried over
            # The library's view of the tokenizer is built before anything is timed.
            compiler.compile(StructuredOutputsParams(choice=["x"], backend=backend))
            row[backend] = walk_steps(compiler, dataclasses.replace(spec, backend=backend), args.rows, args.steps)
        row["auto"] = GrammarCompiler(tokenizer, source.config.vocab_size,
                                      frozenset(source.config.eos_token_ids)).compile(spec).backend
        results.append(row)
    print(f"\n{args.rows} rows, median of {args.steps} steps, {os.cpu_count()} cores, threads={args.threads or 'default'}")
    print("| constraint | auto takes | fill ms xgrammar / llguidance | advance ms xgrammar / llguidance "
          "| compile ms xgrammar / llguidance |")
    print("|---|---|---|---|---|")
    for r in results:
        x, g = r["xgrammar"], r["guidance"]
        print(f"| {r['constraint']} | {r['auto']} | {x['fill_ms']:.2f} / {g['fill_ms']:.2f} | "
              f"{x['advance_ms']:.2f} / {g['advance_ms']:.2f} | {x['compile_ms']:.1f} / {g['compile_ms']:.1f} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(rows=args.rows, steps=args.steps, threads=args.threads, cores=os.cpu_count(),
                       torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
