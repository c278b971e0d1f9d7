"""Host time of one engine step, the model left out: schedule, build the step's inputs, book its tokens.

    python bench/host_step.py [--batch-sizes 1 64 256] [--steps 200] [--json bench/results/host_step.json]

Why: a decode step's device work shrinks with every kernel change, but the host's part (once per
sequence per step: scheduling, input lists, appending tokens, stop checks, prefix-cache bookkeeping)
grows with the batch, and the device waits for it between steps. Here the runner's ``execute`` is
replaced by ``host_batch`` (the runner's own host pass) plus a fixed token per sequence, so the time is
the engine's host work alone. B requests (512-token prompts, ``ignore_eos``) decode; median of
``--steps`` ``llm.step()`` calls. A random llama-tiny checkpoint on the CPU: no device needed. Compare
trees by running it with each on ``PYTHONPATH``, back to back on the same machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    from tidyrun import LLM, SamplingParams
    from tidyrun.runner.input_batch import host_batch
    from tidyrun.sequence import SampledTokens, StepOutput
    from tidyrun.synthetic import write_random_checkpoint

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 64, 256])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default="bench/results/host_step.json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_random_checkpoint(os.path.join(tmp, "ckpt"), "llama-tiny", device="cpu")
        llm = LLM(ckpt, device="cpu", dtype="float32", max_num_seqs=max(args.batch_sizes),
                  max_model_len=512 + args.steps + 64)

        def execute(batch):  # the runner's host pass, no model
            _, seqs, _ = host_batch(batch, llm.runner.block_size)
            return StepOutput([SampledTokens(s, [7]) for s in seqs], [])

        llm.runner.execute = execute
        params = SamplingParams(temperature=0, max_tokens=args.steps + 32, ignore_eos=True)
        try:
            for b in args.batch_sizes:
                ids = [llm.add_request({"prompt_token_ids": list(range(10, 522))}, params) for _ in range(b)]
                for _ in range(5):  # prefill, then decoding
                    llm.step()
                times = []
                for _ in range(args.steps):
                    t0 = time.perf_counter()
                    llm.step()
                    times.append(time.perf_counter() - t0)
                rows.append(dict(batch=b, median_us=statistics.median(times) * 1e6,
                                 mean_us=statistics.fmean(times) * 1e6))
                for request_id in ids:
                    llm.abort_request(request_id)
                while llm.has_unfinished_requests():
                    llm.step()
        finally:
            llm.shutdown()
    print("| batch | host us/step (median) | mean | us per sequence |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['median_us']:.0f} | {r['mean_us']:.0f} | {r['median_us'] / r['batch']:.2f} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
