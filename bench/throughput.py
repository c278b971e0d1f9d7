"""Offline throughput against transformers, and decode step time against the memory-bandwidth floor.

    python bench/throughput.py [--modes graphs eager] [--hf-batch-size 64] [--hf-requests 256]
                               [--batch-sizes 1 16 64 256] [--json bench/results/throughput.json]

(a) One ``llm.generate`` over 256 requests (random token-id prompts of 100-1024
tokens, 100-1024 greedy output tokens each, ``ignore_eos``; ``random.Random(0)``),
output tokens / wall seconds. transformers runs the same requests on the same
checkpoint in request order, in left-padded batches of ``--hf-batch-size``, each
batch generating its longest output; only each request's own output tokens count.
(b) ``llm.step()`` time with B requests decoding (prompt ``--decode-prompt-len``),
median of ``--decode-steps`` steps (``async`` mode: their mean, the loop timed whole, since a step
overlaps the launch of the next), against the floor (weight bytes + KV bytes read
per step) / ``--peak-bw``; for a mixture of experts the weight bytes count only the
experts routed to (``unrouted_expert_bytes``). With both parts, an idealised time for (a) from
the measured prefill rate and step times (``ideal_seconds``) is printed next to the measured one.
(c) The compiled peer of (b): transformers' own fast decode loop on the same checkpoint (a ``StaticCache``
and ``torch.compile(mode="reduce-overhead", fullgraph=True)`` over one decode step, the recipe of
transformers' inference-optimization guide), greedy, B = ``--compiled-batch-sizes``, the same prompt length:
median of per-step times (each synchronized) and the block mean of the steps timed whole. Each engine runs
alone on the device: tidyrun engines are shut down before the next starts, transformers runs last.

The random-weight checkpoint (tidyrun.synthetic) is written to
/tmp/tidyrun-bench/<shape> if missing. CPU smoke test:

    python bench/throughput.py --device cpu --dtype float32 --shape llama-tiny --num-requests 4 \
        --prompt-len-range 10 30 --output-len-range 5 10 --batch-sizes 1 2 --decode-prompt-len 16 \
        --decode-steps 5 --hf-batch-size 2 --json /tmp/tp.json
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import platform
import random
import statistics
import time

import torch

Workload = tuple[list[list[int]], list[int]]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def make_workload(n: int, prompt_range: list[int], output_range: list[int], vocab: int, seed: int) -> Workload:
    """``n`` random token-id prompts and output lengths, both uniform in their inclusive ranges."""
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        plen = rng.randint(*prompt_range)
        outs.append(rng.randint(*output_range))
        prompts.append([rng.randrange(10, vocab - 10) for _ in range(plen)])
    return prompts, outs


def make_llm(ckpt: str, args: argparse.Namespace, mode: str, **kwargs):
    from tidyrun import LLM

    parts = mode.split("+")  # "invariant+async": both
    if "eager" in parts:
        kwargs["enforce_eager"] = True
    if "invariant" in parts:  # graphs, batch_invariant=True
        kwargs["batch_invariant"] = True
    kwargs["async_scheduling"] = "async" in parts  # explicit both ways: the engine's default is on for CUDA
    return LLM(ckpt, device=args.device, dtype=args.dtype, **kwargs)


def tidyrun_throughput(ckpt: str, args: argparse.Namespace, mode: str, work: Workload, warm: Workload,
                       **engine_kwargs) -> dict:
    from tidyrun import SamplingParams

    llm = make_llm(ckpt, args, mode, **engine_kwargs)
    try:
        llm.generate([{"prompt_token_ids": p} for p in warm[0]],
                     SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work[1]]
        rounds = []  # the first round on a fresh machine also compiles Triton kernels the warm-up did not reach
        for _ in range(args.rounds):
            sync(args.device)
            t0 = time.perf_counter()
            outputs = llm.generate([{"prompt_token_ids": p} for p in work[0]], params, use_tqdm=False)
            sync(args.device)
            rounds.append(time.perf_counter() - t0)
        wall = rounds[-1]
        preemptions = llm.stats()["preemptions"]
        mc, elem = llm.runner.model_config, torch.empty((), dtype=llm.dtype).element_size()
        floor = floor_seconds(work, llm.runner.arena.nbytes, mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem,
                              args.peak_bw, 2 * token_matmul_elements(mc, llm.runner.arena.nbytes, elem),
                              args.peak_flops)
    finally:
        llm.shutdown()
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return dict(engine=f"tidyrun ({mode})", requests=len(work[0]), output_tokens=tokens,
                expected_tokens=sum(work[1]), computed_tokens=tokens, wall_s=wall, tok_s=tokens / wall,
                preemptions=preemptions, floor_s=floor, rounds_s=rounds)


def token_matmul_elements(mc, weight_bytes: int, elem: int) -> float:
    """Weight elements one token multiplies (its FLOPs are twice that): all the weights but an untied input
    embedding (a lookup, not a product) and, for a mixture of experts, the experts it is not routed to."""
    untied_embedding = 0 if mc.tie_word_embeddings else mc.vocab_size * mc.hidden_size * elem
    return (weight_bytes - untied_embedding - unrouted_expert_bytes(mc, 1, elem)) / elem


def floor_seconds(work: Workload, weight_bytes: int, kv_bytes_per_token: int, peak_bw: float,
                  flops_per_token: float, peak_flops: float) -> float:
    """A physical floor for workload (a): every prompt token's weight FLOPs at ``peak_flops`` (attention's
    left out), then every decode step costing its products, the longer of reading the weights once at
    ``peak_bw`` and its rows' weight FLOPs at ``peak_flops`` (at 256 rows of a 1.2B model they are
    compute-bound), plus its attention, the KV of each running request's whole context (prompt + tokens so
    far) at ``peak_bw``: kernels run one after another, so the two do not overlap. Unlike ``ideal_seconds``
    it charges the contexts (a) really has (up to 2048 keys, where the decode step measured at
    ``--decode-prompt-len`` reads 512), so it shows how far the engine is from the hardware, not from its
    own step times."""
    prompts, outs = work
    total = sum(len(p) for p in prompts) * flops_per_token / peak_flops  # the prefill also samples token 1
    for step in range(1, max(outs, default=0)):  # decode step `step` feeds token `step`: prompt + step keys
        running = [len(p) for p, n in zip(prompts, outs) if n > step]
        keys = sum(running) + step * len(running)
        total += max(weight_bytes / peak_bw, len(running) * flops_per_token / peak_flops)
        total += keys * kv_bytes_per_token / peak_bw
    return total


def hf_model(ckpt: str, args: argparse.Namespace):
    """The transformers model of the checkpoint (sdpa attention) on the bench's device, for (a) and (c)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt, dtype=getattr(torch, args.dtype),
                                                attn_implementation="sdpa").to(args.device).eval()


def release_memory(args: argparse.Namespace) -> None:
    """After a transformers run dropped its model: collect it and give its cached device memory back, so the
    next engine starts on an empty device."""
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()


def hf_throughput(ckpt: str, args: argparse.Namespace, work: Workload, warm: Workload) -> dict:
    model = hf_model(ckpt, args)

    def run(prompts: list[list[int]], outs: list[int]) -> int:
        """Generate one left-padded batch; returns the tokens computed (batch x longest output)."""
        width, new = max(map(len, prompts)), max(outs)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                                 do_sample=False, max_new_tokens=new, min_new_tokens=new, eos_token_id=None,
                                 pad_token_id=0)
        assert out.shape[1] - width == new, f"transformers stopped after {out.shape[1] - width} of {new} tokens"
        return len(prompts) * new

    bs = args.hf_batch_size
    run(warm[0][:bs], [16] * len(warm[0][:bs]))
    prompts, outs = work[0][:args.hf_requests], work[1][:args.hf_requests]
    sync(args.device)
    t0 = time.perf_counter()
    computed = sum(run(prompts[i:i + bs], outs[i:i + bs]) for i in range(0, len(prompts), bs))
    sync(args.device)
    wall = time.perf_counter() - t0
    del model
    release_memory(args)
    return dict(engine=f"transformers (sdpa, batch {bs})", requests=len(prompts), output_tokens=sum(outs),
                expected_tokens=sum(outs), computed_tokens=computed, wall_s=wall, tok_s=sum(outs) / wall,
                preemptions=0)


def hf_compiled_decode(ckpt: str, args: argparse.Namespace) -> list[dict]:
    """(c): transformers' compiled static-cache decode step at each of ``--compiled-batch-sizes``."""
    from transformers import StaticCache

    model = hf_model(ckpt, args)

    def decode_one(token, position, cache):
        logits = model(token, position_ids=position[None].expand(token.shape[0], 1), cache_position=position,
                       past_key_values=cache, return_dict=False, use_cache=True)[0]
        return logits[:, -1].argmax(-1, keepdim=True)

    # dynamic=False: each batch size compiles (and captures) its own static step, as the guide's loop does
    step = torch.compile(decode_one, mode="reduce-overhead", fullgraph=True, dynamic=False)
    plen, k = args.decode_prompt_len, args.decode_steps
    rows, rng = [], random.Random(2)
    for b in args.compiled_batch_sizes:
        cache = StaticCache(config=model.config, max_cache_len=plen + k + 16)
        prompt = torch.tensor([[rng.randrange(10, model.config.vocab_size - 10) for _ in range(plen)]
                               for _ in range(b)], device=args.device)
        with torch.inference_mode():
            logits = model(prompt, cache_position=torch.arange(plen, device=args.device), past_key_values=cache,
                           return_dict=False, use_cache=True)[0]
            token, positions = logits[:, -1].argmax(-1, keepdim=True), itertools.count(plen)

            def advance(token):  # one decode step; the compiled graph's output is cloned before it is fed back
                return step(token.clone(), torch.tensor([next(positions)], device=args.device), cache)

            for _ in range(5):  # compile and capture (reduce-overhead's CUDA graph takes a few calls)
                token = advance(token)
            times = []
            for _ in range(k // 2):  # each step alone: synchronized before and after
                sync(args.device)
                t0 = time.perf_counter()
                token = advance(token)
                sync(args.device)
                times.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for _ in range(k - k // 2):  # the steps timed whole, as a generation loop runs them
                token = advance(token)
            sync(args.device)
            block = (time.perf_counter() - t0) / (k - k // 2)
        rows.append(dict(engine='transformers (StaticCache + torch.compile "reduce-overhead")', batch=b,
                         median_step_ms=statistics.median(times) * 1e3, block_mean_step_ms=block * 1e3,
                         tok_s=b / statistics.median(times)))
    del model, step
    release_memory(args)
    return rows


def unrouted_expert_bytes(mc, batch: int, elem: int) -> int:
    """Expert weight bytes a decode step of ``batch`` tokens need not read: for a mixture of experts, the
    experts no token chose, in expectation under uniform routing (an expert escapes one token with
    probability 1 - k/E; random weights route close to uniformly). 0 for dense models."""
    if not mc.num_experts:
        return 0
    layers = sum(mc.is_moe_layer(i) for i in range(mc.num_layers))
    per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size * elem
    unchosen = (1 - mc.num_experts_per_tok / mc.num_experts) ** batch
    return int(layers * mc.num_experts * per_expert * unchosen)


def decode_steps(ckpt: str, args: argparse.Namespace, mode: str) -> list[dict]:
    """Median ``llm.step()`` time with B requests all decoding, for each B in ``--batch-sizes``."""
    from tidyrun import SamplingParams

    llm = make_llm(ckpt, args, mode, max_num_seqs=max(256, *args.batch_sizes))
    rows = []
    try:
        mc, weight_bytes = llm.runner.model_config, llm.runner.arena.nbytes
        elem = torch.empty((), dtype=llm.dtype).element_size()
        plen, k = args.decode_prompt_len, args.decode_steps
        max_tokens = min(10000, llm.max_model_len - plen - 1)
        assert max_tokens > k + 16, f"--decode-prompt-len {plen} leaves too few tokens to decode"
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        rng = random.Random(2)
        for b in args.batch_sizes:
            rids = [llm.add_request({"prompt_token_ids": [rng.randrange(10, mc.vocab_size - 10) for _ in range(plen)]},
                                    params) for _ in range(b)]
            sync(args.device)
            t_prefill = time.perf_counter()
            while not all(llm.request_output(r).outputs[0].token_ids for r in rids):  # every prefill done
                llm.step()
            sync(args.device)
            prefill_tok_s = b * plen / (time.perf_counter() - t_prefill)
            for _ in range(3):
                llm.step()
            start = [llm.request_output(r) for r in rids]
            ctx = statistics.fmean(len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in start) + (k - 1) / 2
            preempt0 = llm.stats()["preemptions"]
            times = []
            sync(args.device)
            overlapped = "async" in mode.split("+")
            if overlapped:  # a step overlaps the next one's launch: synchronizing each would undo that
                t0 = time.perf_counter()
                for _ in range(k):
                    llm.step()
                sync(args.device)
                times = [(time.perf_counter() - t0) / k]
            for _ in range(0 if overlapped else k):
                t0 = time.perf_counter()
                llm.step()
                sync(args.device)
                times.append(time.perf_counter() - t0)
            stats = llm.stats()
            assert stats["running"] == b and stats["preemptions"] == preempt0, "not every request decoded every step"
            for r in rids:
                llm.abort_request(r)
            while llm.has_unfinished_requests():
                llm.step()
            kv_bytes = b * ctx * mc.num_layers * 2 * mc.num_kv_heads * mc.head_dim * elem
            step = statistics.median(times)
            read = weight_bytes - unrouted_expert_bytes(mc, b, elem)
            floor = (read + kv_bytes) / args.peak_bw
            rows.append(dict(mode=mode, batch=b, prefill_tok_s=prefill_tok_s, median_step_ms=step * 1e3, mean_step_ms=statistics.fmean(times) * 1e3,
                             tok_s=b / step, mean_context=ctx, weight_bytes=read, kv_bytes_per_step=kv_bytes,
                             floor_ms=floor * 1e3, floor_fraction=floor / step, steps_ms=[t * 1e3 for t in times]))
    finally:
        llm.shutdown()
    return rows


def ideal_seconds(work: Workload, decode: list[dict]) -> float | None:
    """An idealised time for workload (a): every prompt prefilled at the best measured prefill rate, then all
    requests decoding together (perfect batching, no preemption, no host gaps between steps), step s costing
    the measured median step time at the number of requests still running, linearly interpolated between the
    measured batch sizes (their context was ``--decode-prompt-len``; real contexts grow, so this is a bound
    only up to that). None without decode rows, or when the largest measured batch is below the number of
    requests: a step's time is far from proportional to its rows, so it is not extrapolated."""
    if not decode or max(r["batch"] for r in decode) < len(work[1]):
        return None
    points = sorted({r["batch"]: r["median_step_ms"] / 1e3 for r in decode}.items())
    rate = max(r["prefill_tok_s"] for r in decode)

    def step_s(batch: int) -> float:
        for (b0, t0), (b1, t1) in zip(points, points[1:]):
            if batch <= b1:
                return t0 + (t1 - t0) * (max(batch, b0) - b0) / (b1 - b0)
        return points[0][1]  # one measured batch size (at least the requests): its time for any batch

    outs = sorted(work[1], reverse=True)
    running = len(outs)
    total, step = sum(len(p) for p in work[0]) / rate, 0
    for n in sorted(set(outs)):  # requests of output length n stop after step n
        total += (n - step) * step_s(running)
        running -= outs.count(n)
        step = n
    return total


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """The checkpoint, device and request-mix options this script shares with tp_throughput.py."""
    ap.add_argument("--shape", default="llama-1.2b")
    ap.add_argument("--ckpt", default=None, help="existing checkpoint folder (default: /tmp/tidyrun-bench/<shape>)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--prompt-len-range", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len-range", type=int, nargs=2, default=[100, 1024], metavar=("MIN", "MAX"))


def prepare_workload(args: argparse.Namespace) -> tuple[str, Workload, Workload]:
    """The checkpoint folder (a random one written if missing), the timed workload and the warm-up one."""
    from tidyrun.synthetic import write_random_checkpoint

    ckpt = args.ckpt or os.path.join("/tmp/tidyrun-bench", args.shape)
    if not os.path.exists(os.path.join(ckpt, "config.json")):
        t0 = time.perf_counter()
        write_random_checkpoint(ckpt, args.shape, dtype=torch.bfloat16, device="cuda" if args.device.startswith("cuda")
                                else "cpu")
        print(f"wrote random {args.shape} checkpoint to {ckpt} in {time.perf_counter() - t0:.1f} s")
    with open(os.path.join(ckpt, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    work = make_workload(args.num_requests, args.prompt_len_range, args.output_len_range, vocab, seed=0)
    warm = make_workload(min(8, args.num_requests), args.prompt_len_range, args.output_len_range, vocab, seed=1)
    return ckpt, work, warm


def main() -> None:
    ap = argparse.ArgumentParser()
    add_workload_args(ap)
    ap.add_argument("--modes", nargs="+", choices=["graphs", "eager", "invariant", "async", "invariant+async"],
                    default=["graphs"], help="graphs: CUDA graphs, synchronous steps (async_scheduling=False); eager: "
                    "enforce_eager=True; invariant: batch_invariant=True; async: async_scheduling=True (the "
                    "engine's default on CUDA); invariant+async: both")
    ap.add_argument("--enforce-eager", action="store_true", help="same as --modes eager")
    ap.add_argument("--hf-batch-size", type=int, default=64)
    ap.add_argument("--hf-requests", type=int, default=None, help="run transformers on the first N requests only")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--decode-prompt-len", type=int, default=512)
    ap.add_argument("--decode-steps", type=int, default=50)
    ap.add_argument("--peak-bw", type=float, default=4.3e12, help="memory bandwidth of the floor, bytes/s")
    ap.add_argument("--peak-flops", type=float, default=790e12,
                    help="matmul rate of (a)'s prefill floor, FLOP/s (the H200's measured bf16 rate)")
    ap.add_argument("--rounds", type=int, default=2, help="run (a) this many times per engine and report the last: "
                    "on a fresh machine the first also compiles Triton kernels (H100: 7.05 s against 4.17 s after)")
    ap.add_argument("--compiled-batch-sizes", type=int, nargs="+", default=[1, 8],
                    help="(c): batch sizes of transformers' compiled static-cache decode step")
    ap.add_argument("--skip-compiled", action="store_true", help="skip (c), transformers' compiled decode step")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--json", default="bench/results/throughput.json")
    args = ap.parse_args()
    if args.enforce_eager:
        args.modes = ["eager"]
    args.hf_requests = min(args.hf_requests or args.num_requests, args.num_requests)
    ckpt, work, warm = prepare_workload(args)

    throughput, decode = [], []
    if not args.skip_throughput:
        throughput += [tidyrun_throughput(ckpt, args, mode, work, warm) for mode in args.modes]
    if not args.skip_decode:
        decode += [row for mode in args.modes for row in decode_steps(ckpt, args, mode)]
    if not args.skip_throughput and not args.skip_hf:
        throughput.append(hf_throughput(ckpt, args, work, warm))
    compiled = [] if args.skip_compiled or args.skip_decode else hf_compiled_decode(ckpt, args)

    import transformers

    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu"
    print(f"\nshape {args.shape} ({args.dtype}), {device}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    hf = next((r for r in throughput if r["engine"].startswith("transformers")), None)
    if throughput:
        print(f"\n(a) {args.num_requests} requests, prompt {args.prompt_len_range[0]}-{args.prompt_len_range[1]}, "
              f"output {args.output_len_range[0]}-{args.output_len_range[1]} tokens")
        print("| engine | requests | output tokens | computed tokens | wall s | tok/s | vs transformers | floor s "
              "| floor / measured |")
        print("|---|---|---|---|---|---|---|---|---|")
        for r in throughput:
            r["vs_transformers"] = r["tok_s"] / hf["tok_s"] if hf else None
            ratio = f"{r['vs_transformers']:.1f}x" if hf else "-"
            floor = f"{r['floor_s']:.2f} | {r['floor_s'] / r['wall_s']:.0%}" if "floor_s" in r else "- | -"
            print(f"| {r['engine']} | {r['requests']} | {r['output_tokens']} | {r['computed_tokens']} "
                  f"| {r['wall_s']:.2f} | {r['tok_s']:.0f} | {ratio} | {floor} |")
        rounds = [f"{r['engine']} {', '.join(f'{t:.2f}' for t in r['rounds_s'])} s"
                  for r in throughput if "rounds_s" in r]
        if rounds and args.rounds > 1:
            print(f"every round (the last is reported): {'; '.join(rounds)}")
        print(f"floor: prompt tokens' weight FLOPs at {args.peak_flops / 1e12:.0f} TFLOP/s, then each decode step's "
              f"products (weights at {args.peak_bw / 1e12:.2f} TB/s or rows' FLOPs, the longer) and whole-context "
              f"KV (floor_seconds)")
        ideal = ideal_seconds(work, [r for r in decode if r["mode"] == args.modes[0]])
        if ideal is None and decode:
            print(f"idealised bound: needs decode steps measured up to {len(work[1])} rows (--batch-sizes)")
        if ideal is not None:
            best = next(r["wall_s"] for r in throughput if r["engine"] == f"tidyrun ({args.modes[0]})")
            print(f"idealised bound (prefill at the measured rate, then perfect batching at the measured step "
                  f"times): {ideal:.2f} s, {sum(work[1]) / ideal:.0f} tok/s; tidyrun measured {best:.2f} s "
                  f"({ideal / best:.0%} of the bound's speed)")
    if decode:
        print(f"\n(b) decode step, prompt {args.decode_prompt_len}, median of {args.decode_steps} steps, "
              f"floor at {args.peak_bw / 1e12:.2f} TB/s")
        print("| mode | batch | median step ms | mean step ms | tok/s | mean context | weights read GB | KV GB/step "
              "| floor ms | floor / measured |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in decode:
            print(f"| {r['mode']} | {r['batch']} | {r['median_step_ms']:.2f} | {r['mean_step_ms']:.2f} "
                  f"| {r['tok_s']:.0f} | {r['mean_context']:.0f} | {r['weight_bytes'] / 1e9:.2f} "
                  f"| {r['kv_bytes_per_step'] / 1e9:.3f} | {r['floor_ms']:.2f} | {r['floor_fraction']:.0%} |")
    if compiled:
        print(f"\n(c) the compiled peer: greedy decode step, prompt {args.decode_prompt_len}, the same checkpoint")
        print("| engine | batch | median step ms | block mean ms | tidyrun step ms (b), same batch "
              "| tidyrun speed-up |")
        print("|---|---|---|---|---|---|")
        ours = {r["batch"]: r["median_step_ms"] for r in decode if r["mode"] == args.modes[0]}
        for r in compiled:
            mine = ours.get(r["batch"])
            versus = f"{mine:.2f} | {r['median_step_ms'] / mine:.2f}x" if mine else "- | -"
            print(f"| {r['engine']} | {r['batch']} | {r['median_step_ms']:.2f} | {r['block_mean_step_ms']:.2f} "
                  f"| {versus} |")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(dict(shape=args.shape, dtype=args.dtype, device=device, torch=torch.__version__,
                       transformers=transformers.__version__, args=vars(args), throughput=throughput, decode=decode,
                       compiled=compiled,
                       ideal_s=ideal_seconds(work, [r for r in decode if r["mode"] == args.modes[0]])),
                  f, indent=1)


if __name__ == "__main__":
    main()
