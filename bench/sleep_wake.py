"""Sleep / wake time and bandwidth on the GPU, against pinned host-to-device bandwidth measured in the same run.

    python bench/sleep_wake.py [--shapes llama-1.2b llama-8b] [--json bench/results/sleep_wake.json]

Random-weight checkpoints of real shapes are written first (tidyrun.synthetic).
The engine is built with the default KV sizing (90% of the GPU), so "freed"
is what a trainer gets back.

Each cycle wakes twice: once right after sleeping, and once after a
trainer-like GPU step (``--trainer-s`` seconds of bf16 matmuls, what an RL loop
runs between sleep and wake). Right after a sleep that returned tens of GiB,
the driver is still clearing that memory with the copy engines and the wake
copy gets about half of the PCIe bandwidth (measured 27.5 of 55 GB/s, with the
link at Gen5 x16 throughout); after 0.5 s of other GPU work, or 2 s idle,
the same copy runs at full speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

PROMPTS = ["The quick brown fox", "To be, or not to be", "def main():", "All that glitters"]


def pinned_h2d_gbps(nbytes: int, reps: int = 5) -> float:
    """Best-of-``reps`` bandwidth of one pinned host -> device copy of ``nbytes``."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    del host, dev
    torch.cuda.empty_cache()
    return nbytes / best / 1e9


def trainer_step(seconds: float) -> None:
    """Keep the GPU busy like a training step would (bf16 matmuls), then free what it used."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        a @ a
        torch.cuda.synchronize()
    del a


def bench_shape(shape: str, cycles: int, trainer_s: float) -> dict:
    from tidyrun import LLM, SamplingParams
    from tidyrun.memory import initialize_cuda, sample_memory
    from tidyrun.synthetic import write_random_checkpoint

    ckpt = os.path.join("/tmp/tidyrun-bench", shape)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt, shape, dtype=torch.bfloat16, device="cuda")
        print(f"wrote {shape} in {time.perf_counter() - t0:.1f} s")
    _, base = initialize_cuda()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    llm = LLM(ckpt, device="cuda", dtype="bfloat16")
    weight_bytes = llm.runner.arena.nbytes
    h2d = pinned_h2d_gbps(weight_bytes)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    rows = []
    for cycle in range(cycles):
        awake = sample_memory("cuda", collect=False)
        t0 = time.perf_counter()
        llm.sleep(level=1)
        sleep_s = time.perf_counter() - t0
        asleep = sample_memory("cuda", collect=False)
        d2h = llm.runner.last_transfer["d2h_copy_s"]
        t0 = time.perf_counter()
        llm.wake_up()
        wake_s = time.perf_counter() - t0
        h2d_copy = llm.runner.last_transfer["h2d_copy_s"]
        same = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == ref
        llm.sleep(level=1)
        trainer_step(trainer_s)
        t0 = time.perf_counter()
        llm.wake_up()
        wake_after_s = time.perf_counter() - t0
        after = dict(llm.runner.last_transfer)
        same = same and [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == ref
        rows.append(dict(cycle=cycle, sleep_s=sleep_s, wake_s=wake_s, d2h_copy_s=d2h, h2d_copy_s=h2d_copy,
                         wake_after_trainer_s=wake_after_s, h2d_copy_after_trainer_s=after["h2d_copy_s"],
                         graph_capture_s=after["graph_capture_s"],
                         freed_gib=(awake.driver_used - asleep.driver_used) / 2**30,
                         asleep_above_baseline_mib=(asleep.driver_used - base.driver_used) / 2**20,
                         outputs_identical=same))
    t0 = time.perf_counter()
    llm.sleep(level=2)
    sleep2_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.wake_up()  # allocates only (vLLM's level 2): an RL loop pushes its weights next
    wake2_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.runner.reload_weights()
    reload2_s = time.perf_counter() - t0
    same2 = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)] == ref
    llm.shutdown()
    steady = rows[1:] or rows
    wake_copy = statistics.median(r["h2d_copy_s"] for r in steady)
    wake_total = statistics.median(r["wake_s"] for r in steady)
    copy_after = statistics.median(r["h2d_copy_after_trainer_s"] for r in steady)
    wake_after = statistics.median(r["wake_after_trainer_s"] for r in steady)
    capture = statistics.median(r["graph_capture_s"] for r in steady)
    return dict(shape=shape, weight_gib=weight_bytes / 2**30, pinned_h2d_gbps=h2d,
                first_sleep_s=rows[0]["sleep_s"], sleep_s=statistics.median(r["sleep_s"] for r in steady),
                wake_s=wake_total, wake_copy_gbps=weight_bytes / wake_copy / 1e9,
                wake_total_gbps=weight_bytes / wake_total / 1e9,
                wake_copy_fraction=weight_bytes / wake_copy / 1e9 / h2d,
                wake_total_fraction=weight_bytes / wake_total / 1e9 / h2d,
                wake_after_trainer_s=wake_after, wake_copy_after_trainer_gbps=weight_bytes / copy_after / 1e9,
                wake_copy_after_trainer_fraction=weight_bytes / copy_after / 1e9 / h2d, graph_capture_s=capture,
                freed_gib=statistics.median(r["freed_gib"] for r in steady),
                asleep_above_baseline_mib=max(r["asleep_above_baseline_mib"] for r in rows),
                level2_sleep_s=sleep2_s, level2_wake_s=wake2_s, level2_reload_s=reload2_s,
                outputs_identical=all(r["outputs_identical"] for r in rows) and same2, cycles=rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=["llama-1.2b", "llama-8b"])
    ap.add_argument("--cycles", type=int, default=4)
    ap.add_argument("--trainer-s", type=float, default=0.5, help="GPU work between sleep and the second wake")
    ap.add_argument("--json", default="bench/results/sleep_wake.json")
    args = ap.parse_args()
    results = [bench_shape(s, args.cycles, args.trainer_s) for s in args.shapes]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | weights GiB | freed GiB | asleep vs baseline MiB | first sleep s | sleep s | pinned H2D GB/s "
          "| wake right after sleep: s / copy GB/s / copy vs H2D | wake after trainer step: s / copy GB/s / copy vs H2D "
          "| of which graph capture s | L2 sleep s | L2 wake (allocate only) s | L2 reload s | identical |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['shape']} | {r['weight_gib']:.2f} | {r['freed_gib']:.1f} | {r['asleep_above_baseline_mib']:.0f} "
              f"| {r['first_sleep_s']:.2f} | {r['sleep_s']:.3f} | {r['pinned_h2d_gbps']:.1f} "
              f"| {r['wake_s']:.3f} / {r['wake_copy_gbps']:.1f} / {r['wake_copy_fraction']:.0%} "
              f"| {r['wake_after_trainer_s']:.3f} / {r['wake_copy_after_trainer_gbps']:.1f} / "
              f"{r['wake_copy_after_trainer_fraction']:.0%} | {r['graph_capture_s']:.2f} "
              f"| {r['level2_sleep_s']:.2f} | {r['level2_wake_s']:.3f} | {r['level2_reload_s']:.2f} "
              f"| {r['outputs_identical']} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, results=results), f, indent=1)


if __name__ == "__main__":
    main()
