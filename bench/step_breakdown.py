"""Workload (a) of throughput.py step by step: where the wall time goes, against each step's own floor.

    python bench/step_breakdown.py [--shape llama-1.2b] [--rounds 2] [--profile-rows 39 --profile-keys 900]
                                   [--json bench/results/step_breakdown.json]

The 256 requests of ``throughput.py`` (same ``make_workload``, seed 0) are added at once and stepped to the
end ``--rounds`` times (the first warms Triton's caches; the last is reported). Each ``llm.step()`` call is
timed and filed under the batch it scheduled: the prefill, or decode by rows. A decode step's floor is the
weights plus the KV of its rows' contexts at ``--peak-bw``, so a bucket's floor / wall says how near the
hardware that kind of step runs, at the contexts (a) really has. ``--profile-rows`` adds a torch.profiler
table of 5 decode steps at that many rows and about ``--profile-keys`` keys each. CPU smoke test:

    python bench/step_breakdown.py --device cpu --dtype float32 --shape llama-tiny --num-requests 8 \\
        --prompt-len-range 10 30 --output-len-range 5 10 --rounds 1 --json /tmp/sb.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time

import torch

from throughput import add_workload_args, prepare_workload, sync

BUCKETS = ((16, "decode 1-16"), (64, "decode 17-64"), (128, "decode 65-128"), (192, "decode 129-192"),
           (1 << 30, "decode 193+"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_args(ap)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--peak-bw", type=float, default=4.3e12, help="memory bandwidth of the floor, bytes/s")
    ap.add_argument("--profile-rows", type=int, default=0)
    ap.add_argument("--profile-keys", type=int, default=900)
    ap.add_argument("--json", default="bench/results/step_breakdown.json")
    args = ap.parse_args()
    ckpt, work, warm = prepare_workload(args)

    from tidyrun import LLM, SamplingParams
    from tidyrun.scheduler import Scheduler

    llm = LLM(ckpt, device=args.device, dtype=args.dtype)
    scheduled: list[tuple[int, int, int]] = []  # (rows, new tokens, keys already cached) per scheduled batch
    schedule = Scheduler.schedule

    def recording(self):
        batch = schedule(self)
        if batch.seqs:  # the empty schedule of a finished run launches nothing
            scheduled.append((len(batch.seqs), sum(batch.num_new_tokens),
                              sum(s.num_computed_tokens for s in batch.seqs)))
        return batch

    try:
        mc, elem = llm.runner.model_config, torch.empty((), dtype=llm.dtype).element_size()
        weight_bytes, kv_token = llm.runner.arena.nbytes, mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem
        greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)  # noqa: E731
        llm.generate([{"prompt_token_ids": p} for p in warm[0]], greedy(16), use_tqdm=False)
        Scheduler.schedule = recording
        for _ in range(args.rounds):
            scheduled.clear()
            times = []
            sync(args.device)
            t0 = time.perf_counter()
            for prompt, n in zip(*work):
                llm.add_request({"prompt_token_ids": prompt}, greedy(n))
            while llm.has_unfinished_requests():
                t = time.perf_counter()
                llm.step()
                times.append(time.perf_counter() - t)
            sync(args.device)
            wall = time.perf_counter() - t0
        Scheduler.schedule = schedule
        buckets = collections.defaultdict(lambda: dict(steps=0, wall_s=0.0, floor_s=0.0))
        # Step call i books batch i (under async scheduling it launched batch i + 1 first, and the first call
        # launched batches 0 and 1): its time is mostly the wait for batch i's device work.
        for (rows, tokens, keys), t in zip(scheduled, times):
            prefill = tokens > rows
            name = "prefill" if prefill else next(label for top, label in BUCKETS if rows <= top)
            b = buckets[name]
            b["steps"] += 1
            b["wall_s"] += t
            b["floor_s"] += 0.0 if prefill else (weight_bytes + (keys + rows) * kv_token) / args.peak_bw
        tokens = sum(work[1])
        print(f"(a) {len(work[0])} requests, last of {args.rounds} rounds: {wall:.3f} s, {tokens / wall:.0f} tok/s, "
              f"{len(times)} step calls, host time outside them {wall - sum(times):.3f} s, "
              f"preemptions {llm.stats()['preemptions']}")
        print(f"| steps | count | wall s | floor s at {args.peak_bw / 1e12:.2f} TB/s | floor / wall | ms / step |")
        print("|---|---|---|---|---|---|")
        for name, b in sorted(buckets.items()):
            share = f"{b['floor_s'] / b['wall_s']:.0%}" if b["floor_s"] else "-"
            print(f"| {name} | {b['steps']} | {b['wall_s']:.3f} | {b['floor_s']:.3f} | {share} "
                  f"| {b['wall_s'] / b['steps'] * 1e3:.3f} |")
        profile = None
        if args.profile_rows:
            profile = profile_decode(llm, args, work, greedy)
            print(profile)
    finally:
        Scheduler.schedule = schedule
        llm.shutdown()
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(shape=args.shape, device=args.device, torch=torch.__version__, args=vars(args), wall_s=wall,
                       tok_s=tokens / wall, buckets=buckets, profile=profile), f, indent=1)


def profile_decode(llm, args, work, greedy) -> str:
    """torch.profiler's table of 5 decode steps at ``--profile-rows`` rows of ~``--profile-keys`` keys."""
    from torch.profiler import ProfilerActivity, profile

    prompts = [p[:args.profile_keys] for p in work[0] if len(p) >= args.profile_keys][:args.profile_rows]
    for p in prompts:
        llm.add_request({"prompt_token_ids": p}, greedy(64))
    for _ in range(12):
        llm.step()
    cuda = args.device.startswith("cuda")
    sync(args.device)
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            llm.step()
        sync(args.device)
    while llm.has_unfinished_requests():
        llm.step()
    table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=16,
                                      max_name_column_width=50)
    return f"profile: {len(prompts)} rows, ~{args.profile_keys + 12} keys, 5 decode steps\n{table}"


if __name__ == "__main__":
    main()
