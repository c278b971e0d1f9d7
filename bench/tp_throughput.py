"""Offline throughput with tensor parallelism: tensor_parallel_size 1 vs 2 (vs more) on the same requests.

    python bench/tp_throughput.py --shape llama-1.2b --tp-sizes 1 2 [--json bench/results/tp_llama-1.2b.json]
    python bench/tp_throughput.py --shape llama-8b --tp-sizes 1 2

The workload and its measurement are bench/throughput.py's part (a): one
``llm.generate`` over ``--num-requests`` random-token prompts with greedy,
``ignore_eos`` outputs, output tokens / wall seconds, after a short warm-up.
Tensor-parallel engines run eagerly (their collectives are not captured in
CUDA graphs), so every size is also measured with ``enforce_eager`` to keep
the comparison like for like; size 1 is measured with graphs too. Engines run
one at a time. CPU smoke test:

    python bench/tp_throughput.py --device cpu --dtype float32 --shape llama-tiny --num-requests 4 \
        --prompt-len-range 10 30 --output-len-range 5 10 --json /tmp/tp.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from throughput import add_workload_args, prepare_workload, tidyrun_throughput


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--tp-sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--json", default=None, help="default: bench/results/tp_<shape>.json")
    args = ap.parse_args()
    ckpt, work, warm = prepare_workload(args)

    rows = []
    for size in args.tp_sizes:
        modes = ["graphs", "eager"] if size == 1 and args.device.startswith("cuda") else ["eager"]
        for mode in modes:
            row = tidyrun_throughput(ckpt, args, mode, work, warm, tensor_parallel_size=size)
            row["tensor_parallel_size"] = size
            rows.append(row)
    base = next(r for r in rows if r["engine"] == "tidyrun (eager)")
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    print(f"\nshape {args.shape} ({args.dtype}), {device}, torch {torch.__version__}: {args.num_requests} requests, "
          f"prompt {args.prompt_len_range[0]}-{args.prompt_len_range[1]}, "
          f"output {args.output_len_range[0]}-{args.output_len_range[1]} tokens")
    print("| tensor_parallel_size | mode | output tokens | wall s | tok/s | vs size 1 eager |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        r["vs_tp1_eager"] = r["tok_s"] / base["tok_s"]
        print(f"| {r['tensor_parallel_size']} | {r['engine'].removeprefix('tidyrun ')} | {r['output_tokens']} "
              f"| {r['wall_s']:.2f} | {r['tok_s']:.0f} | {r['vs_tp1_eager']:.2f}x |")
    out = args.json or f"bench/results/tp_{args.shape}.json"
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(dict(shape=args.shape, dtype=args.dtype, device=device, torch=torch.__version__, args=vars(args),
                       throughput=rows), f, indent=1)


if __name__ == "__main__":
    main()
