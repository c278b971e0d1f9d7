"""The grouped Triton experts against the per-expert torch path and the bandwidth floor of the routed experts.

    python bench/moe.py [--tokens 1 16 64 256 2048] [--json bench/results/moe.json]

For each expert shape (OLMoE-1B-7B, Qwen3-30B-A3B, Mixtral-8x7B; one layer,
bf16) and each token count T: routing drawn from the softmax of random
scores (``torch.Generator`` seed 0), then the median over 20 CUDA-graph
replays (Triton) or eager calls (torch: it reads the routing on the host) of
``ops.moe_experts``. The floor is the bytes that must be read: the weights of
the distinct experts the routing chose (3 x hidden x intermediate each), plus
the activations in and out, at ``--peak-bw``. The torch path is the reference
the model uses on the CPU, i.e. transformers' per-expert loop.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

SHAPES = {  # name: (hidden, expert intermediate, experts, top-k)
    "olmoe-1b-7b": (2048, 1024, 64, 8),
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "mixtral-8x7b": (4096, 14336, 8, 2),
}


def timed(fn, graph: bool, reps: int = 20) -> float:
    """Median seconds per call; with ``graph`` the call is captured once and replayed (no launch overhead)."""
    if graph:
        fn()  # compile and warm up outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    from tidyrun.model.moe import route
    from tidyrun.model.ops import TorchOps, TritonOps

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256, 2048])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES))
    ap.add_argument("--peak-bw", type=float, default=4.3e12)
    ap.add_argument("--json", default="bench/results/moe.json")
    args = ap.parse_args()
    torch_ops = TorchOps()
    triton_ops = TritonOps(torch.cuda.get_device_properties(0).multi_processor_count)
    rows = []
    for name in args.shapes:
        hidden, inter, experts, top_k = SHAPES[name]
        g = torch.Generator(device="cuda").manual_seed(0)
        to = dict(device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(experts, 2 * inter, hidden, generator=g, **to) * hidden ** -0.5
        w2 = torch.randn(experts, hidden, inter, generator=g, **to) * inter ** -0.5
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=g, **to)
            weights, ids = route(torch.randn(tokens, experts, generator=g, device="cuda"), top_k, True)
            routed = ids.unique().numel()
            moved = routed * 3 * hidden * inter * 2 + tokens * hidden * 2 * 2
            t_triton = timed(lambda: triton_ops.moe_experts(x, w13, w2, weights, ids), graph=True)
            t_torch = timed(lambda: torch_ops.moe_experts(x, w13, w2, weights, ids), graph=False)
            err = (triton_ops.moe_experts(x, w13, w2, weights, ids).float()
                   - torch_ops.moe_experts(x, w13, w2, weights, ids).float()).abs().max().item()
            floor = moved / args.peak_bw
            rows.append(dict(shape=name, tokens=tokens, experts_routed=routed, bytes=moved, triton_us=t_triton * 1e6,
                             torch_us=t_torch * 1e6, floor_us=floor * 1e6, floor_fraction=floor / t_triton,
                             speedup=t_torch / t_triton, max_abs_diff=err,
                             tflops=2 * tokens * top_k * 3 * hidden * inter / t_triton / 1e12))
            del x
        del w13, w2
        torch.cuda.empty_cache()
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, one layer, floor at "
          f"{args.peak_bw / 1e12:.1f} TB/s over the routed experts' weights")
    print("| shape | tokens | experts routed | triton us | torch us | speed-up | floor us | floor / triton "
          "| TFLOP/s | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['shape']} | {r['tokens']} | {r['experts_routed']} | {r['triton_us']:.1f} | {r['torch_us']:.1f} "
              f"| {r['speedup']:.1f}x | {r['floor_us']:.1f} | {r['floor_fraction']:.0%} | {r['tflops']:.0f} "
              f"| {r['max_abs_diff']:.3f} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
