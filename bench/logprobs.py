"""What logprobs and structured outputs cost: decode step time with and without them, in one run.

    python bench/logprobs.py [--shape llama-1.2b] [--batch-sizes 1 16 64 256] [--json bench/results/logprobs.json]

(a) Decode: B requests decoding (random prompts of ``--decode-prompt-len``
tokens), median ``llm.step()`` time over ``--rounds`` x ``--decode-steps``
steps, the two sides alternating round by round, for
``SamplingParams(logprobs=None)`` vs ``logprobs=0`` (what TRL and verl send),
greedy and at temperature 1 (RL rollouts); one engine, same requests.
(b) Structured outputs on the default model and on random ``--structured-shapes``
checkpoints that carry its tokenizer (a real 49k-token vocabulary, so the
grammar's per-token mask costs what it costs users): ``--json-requests``
requests at temperature 1, each generating until its JSON object is complete,
vs the same requests unconstrained with the same token counts, the two
alternating round by round; reported per output token.
(c) JSON decode step: B requests (``--json-batches``) decoding under a JSON
array of (b)'s objects that cannot close (``RECORDS``), at temperature 1,
vs the same rows unconstrained: the mean of ``--decode-steps`` consecutive
``llm.step()`` calls synchronised only around the block (steps launched
ahead overlap as in ``generate``), median of ``--rounds`` alternating
rounds. Where (b) is dominated by short requests' prefill and tail, this is
the steady state of a long structured rollout.

CPU smoke test:

    python bench/logprobs.py --device cpu --dtype float32 --shape llama-tiny --batch-sizes 1 4 \
        --decode-prompt-len 16 --decode-steps 5 --json-requests 4 --structured-shapes llama-tiny --json /tmp/lp.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from throughput import add_workload_args, make_llm, prepare_workload, sync

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                           "city": {"type": "string", "maxLength": 24}},
          "required": ["name", "age", "city"], "additionalProperties": False}


def step_times(llm, params, batch: int, plen: int, steps: int, vocab: int, device: str,
               block: bool = False) -> list[float]:
    """``steps`` step times (s) with ``batch`` requests of ``params`` all decoding, each step synchronised;
    ``block``: one time, the mean of ``steps`` consecutive steps synchronised only before and after the
    block, so that a step launched ahead overlaps the host's next one as in ``generate``."""
    rng = random.Random(2)
    rids = [llm.add_request({"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(plen)]}, params)
            for _ in range(batch)]
    while not all(llm.request_output(r).outputs[0].token_ids for r in rids):
        llm.step()
    for _ in range(3):
        llm.step()
    times = []
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.step()
        if not block:
            sync(device)
            times.append(time.perf_counter() - t0)
    if block:
        sync(device)
        times.append((time.perf_counter() - start) / steps)
    assert llm.stats()["running"] == batch, "not every request decoded every step"
    for r in rids:
        llm.abort_request(r)
    while llm.has_unfinished_requests():
        llm.step()
    return times


def decode_rows(ckpt: str, args: argparse.Namespace, mode: str) -> list[dict]:
    from tidyrun import SamplingParams

    llm = make_llm(ckpt, args, mode, max_num_seqs=max(256, *args.batch_sizes))
    rows = []
    try:
        vocab = llm.runner.model_config.vocab_size
        plen = args.decode_prompt_len
        max_tokens = min(10000, llm.max_model_len - plen - 1)
        for temperature in (0.0, 1.0):
            for b in args.batch_sizes:
                # The two sides alternate (A B A B ...) so that a drift of the machine hits both alike.
                times: dict = {None: [], 0: []}
                for _ in range(args.rounds):
                    for lp in (None, 0):
                        params = SamplingParams(temperature=temperature, seed=0 if temperature else None,
                                                max_tokens=max_tokens, ignore_eos=True, logprobs=lp)
                        times[lp] += step_times(llm, params, b, plen, args.decode_steps, vocab, args.device)
                ms = {lp: statistics.median(t) * 1e3 for lp, t in times.items()}
                rows.append(dict(mode=mode, temperature=temperature, batch=b, plain_ms=ms[None], logprobs0_ms=ms[0],
                                 overhead=ms[0] / ms[None] - 1))
    finally:
        llm.shutdown()
    return rows


def structured_checkpoint(shape: str, device: str) -> str:
    """A random checkpoint of ``shape`` carrying the default model's tokenizer (its real 49k vocabulary, so
    the grammar's masks cost what they cost users; the synthetic tokenizer has 512 tokens)."""
    from transformers import AutoTokenizer

    from tidyrun.loader.default import default_model_path
    from tidyrun.synthetic import SHAPES, write_random_checkpoint

    folder = os.path.join("/tmp/tidyrun-bench", f"{shape}-smollm2-vocab")
    if not os.path.exists(os.path.join(folder, "config.json")):
        write_random_checkpoint(folder, dict(SHAPES[shape], vocab_size=49152), dtype=torch.bfloat16,
                                device="cuda" if device.startswith("cuda") else "cpu")
        path = default_model_path()
        AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).save_pretrained(folder)
    return folder


def structured_rows(args: argparse.Namespace) -> list[dict]:
    """(b) for the default model and each ``--structured-shapes`` entry: the two sides alternate round by
    round (constrained, and unconstrained with the constrained run's token counts); medians over
    ``--rounds``."""
    models = [("default", None)] + [(s, structured_checkpoint(s, args.device)) for s in args.structured_shapes]
    return [structured_row(name, ckpt, args, scheduling) for scheduling in args.structured_scheduling
            for name, ckpt in models]


def structured_row(name: str, ckpt: str | None, args: argparse.Namespace, scheduling: str) -> dict:
    from tidyrun import LLM, SamplingParams, StructuredOutputsParams

    overlap = {"default": None, "async": True, "sync": False}[scheduling]
    llm = LLM(ckpt, device=args.device, dtype=args.dtype, max_model_len=1024, async_scheduling=overlap)
    try:
        prompts = [llm.get_tokenizer().apply_chat_template(
            [{"role": "user", "content": f"Describe person number {i} as JSON with name, age and city."}],
            tokenize=False, add_generation_prompt=True) for i in range(args.json_requests)]
        spec = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
        warm = SamplingParams(temperature=1.0, seed=0, max_tokens=64, structured_outputs=spec)
        llm.generate(prompts, warm, use_tqdm=False)  # both sides' kernels compiled before either is timed
        llm.generate(prompts, SamplingParams(temperature=1.0, seed=0, max_tokens=64), use_tqdm=False)
        params = [SamplingParams(temperature=1.0, seed=i, max_tokens=256, structured_outputs=spec)
                  for i in range(len(prompts))]

        def timed(run_params):
            sync(args.device)
            t0 = time.perf_counter()
            out = llm.generate(prompts, run_params, use_tqdm=False)
            sync(args.device)
            return time.perf_counter() - t0, out

        times: dict[str, list[float]] = {"json": [], "free": []}
        first = None
        for _ in range(args.rounds):
            seconds, out = timed(params)
            times["json"].append(seconds)
            first = first or out
            counts = [len(o.outputs[0].token_ids) for o in first]
            free = [SamplingParams(temperature=1.0, seed=i, max_tokens=n, ignore_eos=True)
                    for i, n in enumerate(counts)]
            times["free"].append(timed(free)[0])
        tokens = sum(counts)
        t = {k: statistics.median(v) for k, v in times.items()}
        return dict(model=name, scheduling=scheduling, requests=len(prompts), output_tokens=tokens,
                    valid=sum(_valid(o.outputs[0].text) for o in first), seconds=times,
                    json_us_per_token=t["json"] / tokens * 1e6, free_us_per_token=t["free"] / tokens * 1e6,
                    overhead=t["json"] / t["free"] - 1)
    finally:
        llm.shutdown()


# (c): a JSON array of SCHEMA's objects that cannot close within the measured steps, so every row stays under
# the grammar (keys, integers, strings, separators) for as long as it decodes.
RECORDS = {"type": "array", "items": SCHEMA, "minItems": 1000}


def json_decode_rows(args: argparse.Namespace) -> list[dict]:
    """(c) for the default model and each ``--structured-shapes`` entry: decode steps of B rows under
    ``RECORDS`` vs the same rows unconstrained, the sides alternating round by round; median over rounds."""
    from tidyrun import LLM, SamplingParams, StructuredOutputsParams

    rows = []
    for name, ckpt in [("default", None)] + [(s, structured_checkpoint(s, args.device)) for s in args.structured_shapes]:
        llm = LLM(ckpt, device=args.device, dtype=args.dtype, max_model_len=1024)
        try:
            vocab = llm.runner.model_config.vocab_size
            spec = StructuredOutputsParams(json=RECORDS, disable_any_whitespace=True)
            plen, max_tokens = 128, 1024 - 128 - 1
            sides = {"json": SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, structured_outputs=spec),
                     "free": SamplingParams(temperature=1.0, seed=0, max_tokens=max_tokens, ignore_eos=True)}
            for params in sides.values():  # kernels and graphs of both sides built before either is timed
                step_times(llm, params, max(args.json_batches), plen, 3, vocab, args.device, block=True)
            for b in args.json_batches:
                ms: dict[str, list[float]] = {"json": [], "free": []}
                for _ in range(args.rounds):
                    for side, params in sides.items():
                        ms[side] += [t * 1e3 for t in step_times(llm, params, b, plen, args.decode_steps, vocab,
                                                                  args.device, block=True)]
                t = {k: statistics.median(v) for k, v in ms.items()}
                rows.append(dict(model=name, batch=b, ms=ms, json_ms=t["json"], free_ms=t["free"],
                                 overhead=t["json"] / t["free"] - 1))
        finally:
            llm.shutdown()
    return rows


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except ValueError:
        return False
    return isinstance(obj, dict) and set(obj) == {"name", "age", "city"} and isinstance(obj["age"], int)


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--decode-prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=20, help="timed steps per round and side")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per side (median over all steps)")
    ap.add_argument("--json-requests", type=int, default=64)
    ap.add_argument("--structured-shapes", nargs="*", default=["llama-1.2b"],
                    help="random checkpoints (with the default model's tokenizer) to run (b) on besides the default model")
    ap.add_argument("--decode-modes", nargs="+", default=["graphs", "graphs+async"],
                    help="engine modes of (a), as throughput.py's --modes (graphs: synchronous steps)")
    ap.add_argument("--structured-scheduling", nargs="+", default=["default"], choices=["default", "async", "sync"],
                    help="async_scheduling of (b)'s engine: the engine's default (on for CUDA), on, off")
    ap.add_argument("--json-batches", type=int, nargs="+", default=[16, 64],
                    help="rows of (c), the steady-state JSON decode step")
    ap.add_argument("--skip-json-decode", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-structured", action="store_true")
    ap.add_argument("--json", default="bench/results/logprobs.json")
    args = ap.parse_args()
    decode = structured = []
    if not args.skip_decode:
        ckpt, _, _ = prepare_workload(args)
        decode = [row for mode in args.decode_modes for row in decode_rows(ckpt, args, mode)]
        print(f"\n(a) decode step, {args.shape} ({args.dtype}), prompt {args.decode_prompt_len}")
        print("| mode | temperature | batch | logprobs=None ms | logprobs=0 ms | overhead |")
        print("|---|---|---|---|---|---|")
        for r in decode:
            print(f"| {r['mode']} | {r['temperature']} | {r['batch']} | {r['plain_ms']:.3f} | {r['logprobs0_ms']:.3f} | "
                  f"{r['overhead'] * 100:+.1f}% |")
    if not args.skip_structured:
        structured = structured_rows(args)
        print(f"\n(b) JSON schema, temperature 1, median of {args.rounds} alternating rounds")
        print("| model | scheduling | requests | output tokens | valid | JSON us/token | unconstrained us/token | overhead |")
        print("|---|---|---|---|---|---|---|---|")
        for r in structured:
            print(f"| {r['model']} | {r['scheduling']} | {r['requests']} | {r['output_tokens']} | {r['valid']} | "
                  f"{r['json_us_per_token']:.1f} | {r['free_us_per_token']:.1f} | {r['overhead'] * 100:+.1f}% |")
    json_decode = []
    if not args.skip_json_decode:
        json_decode = json_decode_rows(args)
        print(f"\n(c) JSON decode step (an array of the schema's objects, temperature 1, default scheduling), mean "
              f"of {args.decode_steps} steps, median of {args.rounds} alternating rounds")
        print("| model | batch | JSON ms/step | unconstrained ms/step | overhead |")
        print("|---|---|---|---|---|")
        for r in json_decode:
            print(f"| {r['model']} | {r['batch']} | {r['json_ms']:.3f} | {r['free_ms']:.3f} | {r['overhead'] * 100:+.1f}% |")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=device, torch=torch.__version__, args=vars(args), decode=decode,
                       structured=structured, json_decode=json_decode), f, indent=1)


if __name__ == "__main__":
    main()
