"""n-gram (prompt-lookup) speculative decoding against plain decoding, on a repetitive workload.

    python bench/spec_decode.py [--k 2 4 8] [--max-tokens 256] [--json bench/results/spec_decode.json]
    python bench/spec_decode.py --device cpu --dtype float32 --max-tokens 32 --prompts 2 --k 4   # smoke test

Default model (SmolLM2-135M-Instruct GGUF), greedy. Prompts ask the model to
rewrite quoted code with a small edit or to summarise a paragraph quoting it,
so the output repeats the prompt. Each engine (speculation off, then ngram
with k draft tokens) is built alone, runs the whole workload once untimed
(kernel compilation), then runs the prompts one request at a time
("sequential") and all in one generate call ("batched"), and is shut down
before the next. Prefix caching is on (the default) in every engine alike, so
timed prompts hit the cache for every engine alike. Outputs are compared with
speculation off. On CUDA, decode steps and draft-verification steps replay
CUDA graphs; --enforce-eager compares both eager.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

SNIPPETS = (
    """def moving_average(values, window):
    out = []
    total = 0.0
    for i, x in enumerate(values):
        total += x
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            out.append(total / window)
    return out


def normalise(values):
    lo = min(values)
    hi = max(values)
    result = []
    for x in values:
        if hi == lo:
            result.append(0.0)
        else:
            result.append((x - lo) / (hi - lo))
    return result""",
    """class Counter:
    def __init__(self):
        self.counts = {}

    def add(self, x):
        if x in self.counts:
            self.counts[x] += 1
        else:
            self.counts[x] = 1

    def most_common(self, n):
        items = sorted(self.counts.items(), key=lambda x: x[1], reverse=True)
        return items[:n]

    def total(self):
        return sum(self.counts.values())


def count_words(text):
    counter = Counter()
    for x in text.split():
        counter.add(x.lower())
    return counter""",
    """def parse_line(line):
    parts = line.strip().split(",")
    name = parts[0]
    x = float(parts[1])
    return name, x


def load(path):
    rows = []
    with open(path) as f:
        for line in f:
            if not line.strip() or line.startswith("#"):
                continue
            name, x = parse_line(line)
            rows.append((name, x))
    return rows


def largest(rows):
    best_name, best_x = None, None
    for name, x in rows:
        if best_x is None or x > best_x:
            best_name, best_x = name, x
    return best_name, best_x""",
)
PARAGRAPHS = (
    "The city council met on Tuesday to discuss the new bus routes. The mayor said that the routes would "
    "start in March. Several residents asked for more buses in the evening. The council agreed to review "
    "the timetable after six months. The new routes will connect the station to the hospital and the "
    "university. Tickets will cost the same as today.",
    "Honey bees live in colonies of up to sixty thousand bees. The queen lays all the eggs. Worker bees "
    "collect nectar and pollen from flowers and bring them back to the hive. In winter the bees cluster "
    "together to stay warm. A colony can produce more honey than it needs, which is why beekeepers can "
    "harvest it. Bees communicate the location of flowers with a dance.",
)
CODE_EDITS = ("Rewrite it exactly, but rename the variable `x` to `value`.",
              "Rewrite it exactly, but add a one-line docstring to every function.")


def build_messages(n: int) -> list[list[dict]]:
    """``n`` distinct single-turn chats; code edits and summaries interleaved so small n has both."""
    code = [f"Here is some code:\n```python\n{s}\n```\n{e}" for e in CODE_EDITS for s in SNIPPETS]
    text = [f"Summarise this text, quoting the key sentences verbatim: {p}" for p in PARAGRAPHS]
    texts: list[str] = []
    for i in range(max(len(code), len(text))):
        texts += code[i:i + 1] + text[i:i + 1]
    return [[{"role": "user", "content": t}] for t in texts[:n]]


def run_engine(args: argparse.Namespace, k: int, messages: list[list[dict]]) -> tuple[dict, dict]:
    """Results by mode ("sequential", "batched") and output token ids by mode, for one engine (k=0: off)."""
    from tidyrun import LLM, SamplingParams

    spec = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 3} if k else None
    eager = {"enforce_eager": True} if args.enforce_eager else {}
    llm = LLM(args.model, device=args.device, dtype=args.dtype, max_model_len=2048, speculative=spec, **eager)
    try:
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        prompts = [{"prompt_token_ids": llm.tokenizer.apply_chat_template(m, True)} for m in messages]
        # Untimed pass over the whole workload in both modes: Triton compiles a kernel variant per tile
        # shape and split count on first use, and the first engine must not pay for the others.
        for p in prompts:
            llm.generate([p], params, use_tqdm=False)
        llm.generate(prompts, params, use_tqdm=False)
        sampled = [0]  # (sequence, step) pairs that produced tokens: one prefill pair per request, then decode
        execute = llm.runner.execute

        def counting_execute(batch) -> list:
            out = execute(batch)
            sampled[0] += len(out)
            return out

        llm.runner.execute = counting_execute
        results, tokens = {}, {}
        for mode in ("sequential", "batched"):
            before, sampled[0] = llm.stats(), 0
            t0 = time.perf_counter()
            if mode == "sequential":
                outs = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
            else:
                outs = llm.generate(prompts, params, use_tqdm=False)
            if llm.device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            after = llm.stats()
            tokens[mode] = [o.outputs[0].token_ids for o in outs]
            total = sum(len(t) for t in tokens[mode])
            drafts = after["spec_draft_tokens"] - before["spec_draft_tokens"]
            accepted = after["spec_accepted_tokens"] - before["spec_accepted_tokens"]
            decode_steps = sampled[0] - len(outs)  # the prefill step gives each request its first token
            per_step = (total - len(outs)) / decode_steps if decode_steps > 0 else None
            results[mode] = dict(k=k, mode=mode, wall_s=wall, output_tokens=total, tokens_per_s=total / wall,
                                 draft_tokens=drafts, accepted_tokens=accepted,
                                 acceptance=accepted / drafts if drafts else None, tokens_per_decode_step=per_step)
        del llm.runner.execute
        return results, tokens
    finally:
        llm.shutdown()


def main() -> None:
    from tidyrun.loader import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--k", type=int, nargs="+", default=[2, 4, 8], help="num_speculative_tokens values (>= 1)")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for plain decode steps either")
    ap.add_argument("--json", default="bench/results/spec_decode.json")
    args = ap.parse_args()
    args.model = args.model or default_model_path()
    messages = build_messages(args.prompts)
    off, off_tokens = run_engine(args, 0, messages)
    rows: list[dict] = []
    for res, toks in [(off, off_tokens)] + [run_engine(args, k, messages) for k in args.k]:
        for mode, r in res.items():
            r["identical"] = sum(a == b for a, b in zip(toks[mode], off_tokens[mode]))
            r["speedup"] = off[mode]["wall_s"] / r["wall_s"]
            rows.append(r)
    rows.sort(key=lambda r: (r["mode"] != "sequential", r["k"]))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    n = len(messages)
    print(f"\n{device}, torch {torch.__version__}, {args.dtype}{', eager' if args.enforce_eager else ''}, "
          f"{n} prompts x {args.max_tokens} max tokens, greedy")
    print("| mode | speculation | wall s | output tokens | tokens/s | speedup | identical to off "
          "| drafts | accepted | acceptance | tokens/decode step |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        acc = "-" if r["acceptance"] is None else f"{r['acceptance']:.0%}"
        tps = "-" if r["tokens_per_decode_step"] is None else f"{r['tokens_per_decode_step']:.2f}"
        print(f"| {r['mode']} | {'off' if r['k'] == 0 else 'ngram k=' + str(r['k'])} | {r['wall_s']:.2f} "
              f"| {r['output_tokens']} | {r['tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['identical']}/{n} "
              f"| {r['draft_tokens']} | {r['accepted_tokens']} | {acc} | {tps} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, model=args.model, dtype=args.dtype,
                       enforce_eager=args.enforce_eager,
                       max_tokens=args.max_tokens, prompts=[m[0]["content"] for m in messages], results=rows),
                  f, indent=1)


if __name__ == "__main__":
    main()
