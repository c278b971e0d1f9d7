"""The few-row products and the argmax of a decode step: cuBLAS/torch against tidyrun.kernels.skinny.

    python bench/skinny.py [--json bench/results/skinny.json]

One row (and 16) of bf16 activations times each weight shape of the 1.2B and
8B Llama shapes and SmolLM2-135M (splits finished in-kernel, as the engine runs
them), and the MLP's gate/up product with its SiLU-mul (cuBLAS + the separate
kernel against the gated skinny kernel). Every timing is a CUDA graph of repeated
calls, so launch cost is not measured; weights rotate through > 300 MB of
copies so they come from HBM, not the 50 MB L2. CUDA only.
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
    from tidyrun.kernels.skinny import argmax_rows, gated_config, skinny_config, skinny_linear

    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default="bench/results/skinny.json")
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    counters = torch.zeros(4096, dtype=torch.int32, device="cuda")
    rows = []
    for gated, shapes in ((False, SHAPES), (True, GATED_SHAPES)):
        for name, (n, k) in shapes.items():
            tile = (gated_config if gated else skinny_config)(n, k, sms)
            weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                       for _ in range(max(2, -(-300_000_000 // (n * k * 2))))]
            for m in (1, 16):
                x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                ref = (lambda w: silu_mul(F.linear(x, w))) if gated else (lambda w: F.linear(x, w))
                cublas = graph_us([lambda w=w: ref(w) for w in weights])
                ours = graph_us([lambda w=w: skinny_linear(x, w, None, tile, counters, gated=gated)
                                 for w in weights]) if tile else None
                rows.append(dict(op=name, rows=m, tile=tile._asdict() if tile else None, torch_us=cublas,
                                 skinny_us=ours))
            del weights
    for vocab in (128256, 49152):
        for m in (1, 16):
            x = torch.randn(m, vocab, device="cuda", dtype=torch.bfloat16)
            assert torch.equal(argmax_rows(x), x.argmax(-1))
            rows.append(dict(op=f"argmax vocab {vocab}", rows=m, tile=None, torch_us=graph_us([lambda: x.argmax(-1)]),
                             skinny_us=graph_us([lambda: argmax_rows(x)])))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, bf16")
    print("| op | rows | torch / cuBLAS us | skinny us | ratio |\n|---|---|---|---|---|")
    for r in rows:
        ours = r["skinny_us"]
        cell = "cuBLAS kept" if ours is None else f"{ours:.1f} | {r['torch_us'] / ours:.2f}x"
        print(f"| {r['op']} | {r['rows']} | {r['torch_us']:.1f} | {cell} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
