"""How fast llguidance's pool fills a step's grammar masks on this host, by pool size and rows.

    cd bench && python3 grammar_pool.py [--threads 1 2 4 8 12] [--rows 64 256] [--json results/grammar_pool.json]

Why: a JSON-schema step costs ~12 us more per row than an unconstrained one on
the H100 host (docs/BENCHMARKS.md), and the engine's grammar work per row per
step is one token consumed and one mask computed (~50 us on one core), spread
over llguidance's pool (80% of the cores by default). This measures that fill
alone, as the engine makes it (``GrammarCompiler.fill_later(states).wait()``):
``--rows`` states under logprobs.py's RECORDS (its schema as a JSON array), each step
handing every state the next token of its own JSON text (valid rows, at
different places in their objects), median and p90 of ``--steps`` steps, for
each pool size in ``--threads``. The default model's tokenizer; no device needed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

from logprobs import RECORDS

NAMES = ["Alice Smith", "Bob", "Carol Ann Jones", "Dmitri", "Eve", "Fatima al-Sayed"]
CITIES = ["Paris", "New York", "Rio de Janeiro", "Oslo", "Kyoto"]


def texts(tokenizer, rows: int, steps: int, seed: int) -> list[list[int]]:
    """Token ids of one JSON array text per row, each at least ``steps`` tokens and starting with its '['."""
    rng = random.Random(seed)
    out = []
    for _ in range(rows):
        items = ",".join(json.dumps({"name": rng.choice(NAMES), "age": rng.randrange(100), "city": rng.choice(CITIES)},
                                    separators=(",", ":")) for _ in range(steps // 8 + 8))
        out.append(tokenizer.encode("[" + items, add_special_tokens=False))
    return out


def fill_times(compiler_class, tokenizer, vocab: int, eos: frozenset[int], spec, threads: int, rows: int,
               steps: int) -> list[float]:
    compiler = compiler_class(tokenizer, vocab, eos, threads=threads)
    try:
        states = [compiler.new_state(spec) for _ in range(rows)]
        ids = texts(tokenizer.hf_tokenizer, rows, steps, seed=rows)
        times = []
        for t in range(steps):
            for state, row in zip(states, ids):
                state.accept_later(row[t])
            t0 = time.perf_counter()
            compiler.fill_later(states).wait()
            times.append(time.perf_counter() - t0)
        errors = sum(s.error is not None for s in states)
        if errors:
            raise RuntimeError(f"{errors} of {rows} states refused their text: the benchmark's texts are wrong")
        return times
    finally:
        compiler.close()


def main() -> None:
    from tidyrun import LLM, StructuredOutputsParams
    from tidyrun.structured.compiler import GrammarCompiler

    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2, 4, 8, 12])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--json", default="results/grammar_pool.json")
    args = ap.parse_args()
    llm = LLM(None, device="cpu", max_model_len=256)  # the default model's tokenizer and eos ids
    try:
        tokenizer, vocab = llm.tokenizer, llm.runner.model_config.vocab_size
        eos = frozenset(llm.tokenizer.eos_token_ids)
    finally:
        llm.shutdown()
    spec = StructuredOutputsParams(json=RECORDS, disable_any_whitespace=True)
    results = []
    print(f"cores {len(os.sched_getaffinity(0))}; fill = consume one token + compute one mask per row, per step")
    print("| pool threads | rows | median ms | p90 ms | us per row |")
    print("|---|---|---|---|---|")
    for rows in args.rows:
        for threads in args.threads:
            t = sorted(fill_times(GrammarCompiler, tokenizer, vocab, eos, spec, threads, rows, args.steps))
            median, p90 = statistics.median(t), t[int(0.9 * (len(t) - 1))]
            results.append(dict(threads=threads, rows=rows, median_ms=median * 1e3, p90_ms=p90 * 1e3))
            print(f"| {threads} | {rows} | {median * 1e3:.2f} | {p90 * 1e3:.2f} | {median * 1e6 / rows:.1f} |", flush=True)
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(cores=len(os.sched_getaffinity(0)), results=results), f, indent=1)


if __name__ == "__main__":
    main()
