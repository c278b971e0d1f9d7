"""Where a JSON-schema step's host time goes, against the same requests unconstrained: per-phase host times.

    cd bench && python3 structured_phases.py [--requests 64] [--rounds 3] [--scheduling default sync] \
        [--json results/structured_phases.json]

The workload of ``logprobs.py`` (b) on the default model: ``--requests`` chat
requests at temperature 1 under its 3-field schema, then the same requests
unconstrained with the constrained run's token counts, alternating round by
round. Each run's wall time, and for the median run the calls and summed host
time of the engine's phases (the engine's and runner's methods, wrapped by
this script: the wrappers add their own small cost to every row). A phase's
time includes the phases it calls (``engine.step`` holds all of them);
``masks.wait`` is the host waiting for the grammar masks, ``collect`` waiting
for the device's tokens.

To compare two trees in one device session, run this script with each on
``PYTHONPATH`` in turn (docs/BENCHMARKS.md did so). CPU smoke test:

    cd bench && python3 structured_phases.py --device cpu --requests 2 --rounds 1 --max-tokens 16
"""

from __future__ import annotations

import argparse
import functools
import json
import time

import torch

from logprobs import SCHEMA


def wrap_phases(acc: dict) -> None:
    """Wrap the phases' functions so that each call adds (1, its seconds) to ``acc[label]``."""
    import tidyrun.engine as engine
    import tidyrun.logits_process as logits_process
    import tidyrun.pipeline as pipeline
    import tidyrun.runner.model_runner as model_runner
    import tidyrun.sampling as sampling
    import tidyrun.scheduler as scheduler
    import tidyrun.structured.compiler as compiler

    def timed(fn, label):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                entry = acc.setdefault(label, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - t0
        return wrapper

    methods = [(engine.LLM, "step", "engine.step"), (engine.LLM, "_enqueue", "enqueue"),
               (pipeline.StepPipeline, "_launch", "launch"), (pipeline.StepPipeline, "_sample", "sample_launched"),
               (pipeline.StepPipeline, "_book", "book"), (pipeline.StepPipeline, "_run", "execute (sync)"),
               (model_runner.ModelRunner, "collect", "collect"),
               (model_runner.ModelRunner, "forward_logits", "forward_logits"),
               (compiler.PendingMasks, "wait", "masks.wait"), (compiler.GrammarCompiler, "fill_later", "fill_later"),
               (compiler.GrammarCompiler, "fill_ahead", "fill_ahead"), (sampling.Sampler, "draw_race", "draw_race"),
               (scheduler.Scheduler, "schedule", "schedule"), (scheduler.Scheduler, "book_output", "book_output")]
    for owner, name, label in methods:
        if name not in owner.__dict__:
            continue  # a tree without this phase
        fn = owner.__dict__[name]
        if isinstance(fn, staticmethod):
            setattr(owner, name, staticmethod(timed(fn.__func__, label)))
        else:
            setattr(owner, name, timed(fn, label))
    model_runner.process_logits = timed(logits_process.process_logits, "process_logits")
    if hasattr(model_runner, "race_inputs"):  # the masked race's noise (draw_race's for the other paths)
        model_runner.race_inputs = timed(sampling.race_inputs, "race_inputs (masked race)")


def run(args: argparse.Namespace, scheduling: str, acc: dict) -> dict:
    from tidyrun import LLM, SamplingParams, StructuredOutputsParams

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    overlap = {"default": None, "async": True, "sync": False}[scheduling]
    llm = LLM(None, device=args.device, max_model_len=1024, async_scheduling=overlap)
    try:
        prompts = [llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": f"Describe person number {i} as JSON with name, age and city."}],
            tokenize=False, add_generation_prompt=True) for i in range(args.requests)]
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        llm.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_tokens=64, structured_outputs=spec),
                     use_tqdm=False)  # kernels, grammar lanes and the llguidance tokenizer built before timing
        llm.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_tokens=64), use_tqdm=False)
        constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=args.max_tokens, structured_outputs=spec)
                       for i in range(len(prompts))]
        runs: dict[str, list] = {"json": [], "free": []}
        counts = None
        for _ in range(args.rounds):
            for side in ("json", "free"):
                params = constrained if side == "json" else [
                    SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True) for i, n in enumerate(counts)]
                acc.clear()
                sync()
                t0 = time.perf_counter()
                out = llm.generate(prompts, params, use_tqdm=False)
                sync()
                seconds = time.perf_counter() - t0
                if side == "json":
                    counts = [len(o.outputs[0].token_ids) for o in out]
                runs[side].append((seconds, {k: tuple(v) for k, v in acc.items()}))
    finally:
        llm.shutdown()
    tokens = sum(counts)
    row = dict(scheduling=scheduling, requests=args.requests, output_tokens=tokens)
    for side, done in runs.items():
        seconds, phases = sorted(done, key=lambda r: r[0])[len(done) // 2]
        row[side] = dict(seconds=[r[0] for r in done], us_per_token=seconds / tokens * 1e6,
                         phases={k: dict(calls=n, ms=s * 1e3) for k, (n, s) in phases.items()})
    row["overhead"] = row["json"]["us_per_token"] / row["free"]["us_per_token"] - 1
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--scheduling", nargs="+", default=["default"], choices=["default", "async", "sync"])
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    acc: dict = {}
    wrap_phases(acc)
    rows = [run(args, s, acc) for s in args.scheduling]
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    for row in rows:
        print(f"\n{row['scheduling']} scheduling, {row['requests']} requests, {row['output_tokens']} tokens, {name}: "
              f"JSON {row['json']['us_per_token']:.1f} vs {row['free']['us_per_token']:.1f} us/token "
              f"({row['overhead']:+.1%})")
        labels = sorted(set(row["json"]["phases"]) | set(row["free"]["phases"]),
                        key=lambda k: -row["json"]["phases"].get(k, {"ms": 0})["ms"])
        print("| phase | JSON calls | JSON ms | free calls | free ms |\n|---|---|---|---|---|")
        for k in labels:
            j, f = row["json"]["phases"].get(k), row["free"]["phases"].get(k)
            print(f"| {k} | {j['calls'] if j else '-'} | {j['ms']:.2f} |" if j else f"| {k} | - | - |", end="")
            print(f" {f['calls']} | {f['ms']:.2f} |" if f else " - | - |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=name, torch=torch.__version__, rows=rows), fh, indent=1)


if __name__ == "__main__":
    main()
