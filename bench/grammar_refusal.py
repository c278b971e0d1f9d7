"""How often a race over the whole vocabulary would pick a token the grammar refuses (JSON schema).

    cd bench && python3 grammar_refusal.py [--device cpu] [--requests 32] [--max-tokens 60] [--json results/grammar_refusal.json]

Why: "grammar rows sampled optimistically" (docs/BENCHMARKS.md, #16) would sample a structured row like an
unconstrained one and redraw only a refused token; each refusal costs the row at least the step launched with
it. At temperature 1 the masked draw is the renormalised distribution over the allowed tokens, so the processed
log-probability of the token drawn minus its raw one is -log P(allowed), and 1 - P(allowed) is the chance that
the unmasked draw at that position would have been refused. Two engines ("raw_logprobs", "processed_logprobs")
draw the same tokens from the same seeds; their records give that chance for every token. Default model, chat
prompts under logprobs.py's SCHEMA; runs on the CPU.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

from logprobs import SCHEMA
from tidyrun import LLM, SamplingParams, StructuredOutputsParams

QUESTIONS = ["Describe a person as JSON.", "Give me a JSON record of a customer.",
             "Invent a character and return it as JSON.", "Return a JSON object about someone who lives in Paris."]


def records(mode: str, args) -> list[tuple[list[int], list[float]]]:
    """Per request: its tokens and each one's log-probability in ``mode``."""
    with LLM(device=args.device, max_model_len=512, logprobs_mode=mode) as llm:
        prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template([{"role": "user", "content": q}])}
                   for q in (QUESTIONS * args.requests)[:args.requests]]
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, logprobs=0,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA)) for i in range(len(prompts))]
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [(c.token_ids, [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)]) for c in (o.outputs[0] for o in outs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--json", default="results/grammar_refusal.json")
    args = ap.parse_args()
    raw, processed = records("raw_logprobs", args), records("processed_logprobs", args)
    chances = []
    for (tokens, a), (same, b) in zip(raw, processed):
        if tokens != same:
            raise SystemExit("the two engines drew different tokens: the comparison needs the same draws")
        chances += [1.0 - math.exp(min(0.0, x - y)) for x, y in zip(a, b)]
    row = {"tokens": len(chances), "mean": statistics.fmean(chances), "median": statistics.median(chances),
           "above_half": sum(c > 0.5 for c in chances) / len(chances)}
    print("| tokens | mean refusal chance | median | share above 0.5 |\n|---|---|---|---|")
    print(f"| {row['tokens']} | {row['mean']:.3f} | {row['median']:.4f} | {row['above_half']:.3f} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump({"args": vars(args), "result": row}, f, indent=1)


if __name__ == "__main__":
    main()
