"""The products and the argmax of a step: cuBLAS/torch against tidyrun.kernels.linear and .argmax.

    python bench/linear.py [--json bench/results/linear.json] [--rows 1,16,64,256,1024,4096] [--ops 1.2B]

Rows of bf16 activations times each weight shape of the 1.2B and 8B Llama
shapes and SmolLM2-135M (few-row splits finished in-kernel, as the engine runs
them), and the MLP's gate/up product with its SiLU-mul (cuBLAS + the separate
kernel against the gated kernel). Above 16 rows the many-row launch is also
timed by pointer loads (``tma=False``) and checked to give the bits of its
tensor-descriptor launch. Up to 16 rows the engine takes the kernel
where it wins ("narrow" plans, gate/up); beyond, and for the wide shapes, only
with ``batch_invariant=True``: those rows are the price of invariance. Every
timing is a CUDA graph of repeated calls, so launch cost is not measured;
weights rotate through > 300 MB of copies so they come from HBM, not the 50 MB
L2. CUDA only.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

SHAPES = {"1.2B o_proj": (2048, 2048), "1.2B down_proj": (2048, 8192), "1.2B qkv_proj": (3072, 2048),
          "8B o_proj": (4096, 4096), "8B down_proj": (4096, 14336), "135M o_proj": (576, 576),
          "135M down_proj": (576, 1536)}
GATED_SHAPES = {"1.2B gate_up+silu": (16384, 2048), "8B gate_up+silu": (28672, 4096), "135M gate_up+silu": (3072, 576)}


def graph_us(fns: list, reps: int = 3) -> float:
    """Microseconds per call of ``fns`` (each once per round), replayed from one CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for f in fns:
            f()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(reps):
                for f in fns:
                    f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 5 / reps / len(fns) * 1e3


def main() -> None:
    from tidyrun.kernels.fused import silu_mul
    from tidyrun.kernels.argmax import argmax_rows
    from tidyrun.kernels.linear import gated_plan, linear, narrow_plan, wide_plan
    from tidyrun.runner.device import hopper_or_later

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/linear.json")
    ap.add_argument("--rows", default="1,16,64,256,1024,4096")
    ap.add_argument("--ops", default="", help="only the products whose name contains this (e.g. 1.2B)")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    tma = hopper_or_later(torch.device("cuda"))  # as the engine decides: descriptors on Hopper and later
    rows = []
    for gated, shapes in ((False, SHAPES), (True, GATED_SHAPES)):
        for name, (n, k) in shapes.items():
            if args.ops not in name:
                continue
            plan = gated_plan(n, k, sms) if gated else narrow_plan(n, k, sms)
            wide = plan is None
            plan = plan or wide_plan(n, k, sms)
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(max(2, -(-300_000_000 // (n * k * 2))))]
            for m in (int(r) for r in args.rows.split(",")):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = (lambda w: silu_mul(F.linear(x, w))) if gated else (lambda w: F.linear(x, w))
                cublas = graph_us([lambda w=w: ref(w) for w in weights])
                def launch(w, descriptors):
                    return linear(x, w, None, plan, counters, gated=gated, tma=descriptors)
                ours = graph_us([lambda w=w: launch(w, tma) for w in weights])
                pointer = None
                if m > 16:  # the many-row launch: by tensor descriptors (above) and by pointer loads, same bits
                    pointer = graph_us([lambda w=w: launch(w, False) for w in weights])
                    assert torch.equal(launch(weights[0], False), launch(weights[0], tma)), \
                        f"{name} at {m} rows: the descriptor launch's bits differ from the pointer launch's"
                rows.append(dict(op=name, rows=m, plan=plan._asdict(), torch_us=cublas, kernel_us=ours,
                                 pointer_us=pointer, engine_default="kernel" if m <= 16 and not wide else "cuBLAS"))
            del weights
    for vocab in (128256, 49152):
        for m in (1, 16):
            x = torch.randn(m, vocab, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(argmax_rows(x), x.argmax(-1))
            rows.append(dict(op=f"argmax vocab {vocab}", rows=m, tile=None, torch_us=graph_us([lambda: x.argmax(-1)]),
                             kernel_us=graph_us([lambda: argmax_rows(x)]), engine_default="kernel"))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    print("| op | rows | torch / cuBLAS us | kernel us | cuBLAS / kernel | pointer-load launch us | engine default |"
          "\n|---|---|---|---|---|---|---|")
    for r in rows:
        pointer = "" if r.get("pointer_us") is None else f"{r['pointer_us']:.1f}"
        print(f"| {r['op']} | {r['rows']} | {r['torch_us']:.1f} | {r['kernel_us']:.1f} | "
              f"{r['torch_us'] / r['kernel_us']:.2f}x | {pointer} | {r['engine_default']} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
