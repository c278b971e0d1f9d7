"""Construction / shutdown time and leftover GPU memory: tidyrun vs transformers' usual recipe.

    python bench/lifecycle.py [--shape llama-1.2b] [--cycles 5] [--kv-cache-gib 64] [--json bench/results/lifecycle.json]

Each engine runs in its own child process of this script, so each starts from
a clean CUDA context; memory is read at three levels (allocated, reserved,
driver used) after CUDA init and again after teardown, in that same process.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time

import torch

PROMPTS = ["The quick brown fox", "To be, or not to be", "def main():", "All that glitters"] * 2


def _baseline():
    """(bare CUDA context, context + cuBLAS handles) readings; see tidyrun.memory.initialize_cuda."""
    from tidyrun.memory import initialize_cuda

    return initialize_cuda("cuda")


def _import_transformers() -> float:
    """Both engines use transformers (tidyrun for its tokenizers): import it outside the timed region."""
    t0 = time.perf_counter()
    import transformers  # noqa: F401
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

    return time.perf_counter() - t0


def worker_tidyrun(ckpt: str, cycles: int, kv_gib: float) -> dict:
    """``cycles`` engines one after another in this process; then one whose parameters the caller holds."""
    from tidyrun import LLM, SamplingParams
    from tidyrun.memory import sample_memory

    import_s = _import_transformers()
    base = _baseline()
    construct, shutdown, after, peak, report = [], [], [], None, None
    for _ in range(cycles):
        t0 = time.perf_counter()
        llm = LLM(ckpt, device="cuda", dtype="bfloat16", kv_cache_memory=int(kv_gib * 2**30))
        construct.append(time.perf_counter() - t0)
        peak = peak or sample_memory("cuda")
        llm.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        report = llm.shutdown()
        shutdown.append(time.perf_counter() - t0)
        after.append(sample_memory("cuda"))
        del llm
    # An RL trainer's habit: keep the parameters. The report must stay fast and must not hold them itself.
    llm = LLM(ckpt, device="cuda", dtype="bfloat16", kv_cache_memory=1 << 30)
    held = dict(llm.runner.model.named_parameters())
    t0 = time.perf_counter()
    held_report = llm.shutdown()
    held_s = time.perf_counter() - t0
    del held, llm
    dropped = sample_memory("cuda", collect=False)
    return dict(engine="tidyrun", recipe="llm.shutdown()", construct_s=construct[0], shutdown_s=shutdown[0],
                shutdown_median_s=sorted(shutdown)[len(shutdown) // 2], shutdown_all_s=shutdown,
                held_gib=(peak.driver_used - base[1].driver_used) / 2**30, **_leftover(base, after[0]),
                left_driver_last_mib=after[-1].delta(base[1]).driver_used / 2**20, cycles=cycles,
                survivors=len(report.survivors), import_s=import_s, kv_cache_gib=report.released_bytes["kv_cache"] / 2**30,
                held_params_survivors=len(held_report.survivors), held_params_shutdown_s=held_s,
                held_params_report=str(held_report).splitlines()[1:3],
                after_dropping_held_allocated_b=dropped.delta(base[1]).allocated)


def worker_transformers(ckpt: str) -> dict:
    import_s = _import_transformers()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tidyrun.memory import sample_memory

    base = _baseline()
    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16, device_map="cuda")
    construct = time.perf_counter() - t0
    peak = sample_memory("cuda")
    tok.pad_token = tok.eos_token
    batch = tok(PROMPTS, return_tensors="pt", padding=True).to("cuda")
    with torch.no_grad():
        model.generate(**batch, max_new_tokens=32, min_new_tokens=32, do_sample=True)
    t0 = time.perf_counter()
    del model, batch
    gc.collect()
    torch.cuda.empty_cache()
    shutdown = time.perf_counter() - t0
    after = sample_memory("cuda")
    return dict(engine="transformers", recipe="del model; gc.collect(); torch.cuda.empty_cache()",
                construct_s=construct, shutdown_s=shutdown, held_gib=(peak.driver_used - base[1].driver_used) / 2**30,
                **_leftover(base, after), survivors=None, import_s=import_s, kv_cache_gib=0.0)


def _leftover(bases, after) -> dict:
    context, blas = bases
    d = after.delta(blas)
    return dict(left_allocated_b=d.allocated, left_reserved_b=d.reserved, left_driver_mib=d.driver_used / 2**20,
                left_driver_vs_bare_context_mib=after.delta(context).driver_used / 2**20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1.2b")
    ap.add_argument("--ckpt", default=None, help="existing checkpoint folder (default: write a random one)")
    ap.add_argument("--json", default="bench/results/lifecycle.json")
    ap.add_argument("--cycles", type=int, default=5, help="tidyrun engines built and shut down one after another")
    ap.add_argument("--kv-cache-gib", type=float, default=64.0)
    ap.add_argument("--worker", choices=["tidyrun", "transformers"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        result = (worker_tidyrun(args.ckpt, args.cycles, args.kv_cache_gib) if args.worker == "tidyrun"
                  else worker_transformers(args.ckpt))
        print("RESULT " + json.dumps(result), flush=True)
        return
    from tidyrun.synthetic import write_random_checkpoint

    ckpt = args.ckpt or os.path.join("/tmp/tidyrun-bench", args.shape)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt, args.shape, dtype=torch.bfloat16, device="cuda")
        print(f"wrote random {args.shape} checkpoint to {ckpt} in {time.perf_counter() - t0:.1f} s")
    rows = []
    for engine in ("tidyrun", "transformers"):
        out = subprocess.run([sys.executable, __file__, "--worker", engine, "--ckpt", ckpt, "--cycles",
                              str(args.cycles), "--kv-cache-gib", str(args.kv_cache_gib)],
                             capture_output=True, text=True, check=False)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            sys.exit(f"{engine} worker failed:\n{out.stdout}\n{out.stderr}")
        rows.append(json.loads(line[len("RESULT "):]))
    print(f"\nshape {args.shape}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| engine | teardown | construct s | shutdown s | held GiB | left allocated B | left reserved B "
          "| left driver MiB | left driver MiB vs bare context |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | `{r['recipe']}` | {r['construct_s']:.2f} | {r['shutdown_s']:.3f} | {r['held_gib']:.2f} | "
              f"{r['left_allocated_b']} | {r['left_reserved_b']} | {r['left_driver_mib']:.1f} "
              f"| {r['left_driver_vs_bare_context_mib']:.1f} |")
    t = rows[0]
    print(f"\ntidyrun, {t['cycles']} engines with a {t['kv_cache_gib']:.0f} GiB KV cache: shutdown "
          f"{', '.join(f'{x * 1e3:.0f}' for x in t['shutdown_all_s'])} ms (median {t['shutdown_median_s'] * 1e3:.0f}); "
          f"driver left after the first {t['left_driver_mib']:.1f} MiB, after the last {t['left_driver_last_mib']:.1f} MiB")
    print(f"held parameters: {t['held_params_survivors']} survivors reported in {t['held_params_shutdown_s']:.3f} s; "
          f"after dropping them: allocated {t['after_dropping_held_allocated_b']} B over the baseline")
    print("\n".join(t["held_params_report"]))
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(shape=args.shape, device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows), f,
                  indent=1)


if __name__ == "__main__":
    main()
