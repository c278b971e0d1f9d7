"""A GRPO-style RL loop: a transformers policy (the trainer) and a tidyrun engine (the rollouts) in one process.

    python examples/grpo_loop.py [--iterations 2] [--device cpu|cuda]

This is the loop TRL's GRPO colocate mode runs, written out: each iteration
rolls out ``n`` completions per prompt with ``logprobs=0``, scores them,
puts the engine to sleep (level 2: weights and KV cache off the device) while
the trainer takes a policy-gradient step, then wakes the weights (allocated
only, nothing re-read), pushes the new ones with ``load_weights`` one tensor
at a time, resets the prefix cache and wakes the KV cache.

It checks what an RL user relies on: the rollout logprobs equal the
trainer's own recomputation on the same tokens (that is what TRL's
importance-sampling correction assumes), and the reward moves. Memory is
printed at every phase (device: allocated / reserved / in use at the driver;
CPU: the process's resident set).
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics

import torch

from tidyrun import LLM, SamplingParams
from tidyrun.loader import default_model_path

PROMPTS = ["What colour is the sky?", "Name a colour.", "Pick a colour for a car.", "Which colour do you like?"]
COLOURS = ("red", "orange", "yellow", "green", "blue", "purple", "violet", "pink", "brown", "black", "white",
           "grey", "gray")


def reward(text: str) -> float:
    """1 for a completion that names a colour: a simple objective the untrained model meets now and then."""
    words = "".join(c if c.isalpha() else " " for c in text.lower()).split()
    return 1.0 if any(w in COLOURS for w in words) else 0.0


def memory(device: str) -> dict[str, float]:
    """Memory now, in MiB: the device's allocator and driver figures, or the process's peak RSS on the CPU."""
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        return {"allocated": torch.cuda.memory_allocated() / 2**20, "reserved": torch.cuda.memory_reserved() / 2**20,
                "driver_used": (total - free) / 2**20}
    return {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10}


def completion_logprobs(policy, pairs: list[tuple[list[int], list[int]]]) -> list[torch.Tensor]:
    """The policy's log-probability of each completion token (teacher-forced, with gradients), for every
    (prompt ids, completion ids) pair in one right-padded forward pass."""
    rows = [p + c for p, c in pairs]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, :len(r)] = torch.tensor(r)
        mask[i, :len(r)] = 1
    ids, mask = ids.to(policy.device), mask.to(policy.device)
    hidden = policy.model(ids, attention_mask=mask).last_hidden_state
    # Only the positions that predict a completion token go through the head and the softmax.
    rows = torch.cat([torch.full((len(c),), i) for i, (_, c) in enumerate(pairs)]).to(ids.device)
    cols = torch.cat([torch.arange(len(p) - 1, len(p) + len(c) - 1) for p, c in pairs]).to(ids.device)
    targets = torch.tensor([t for _, c in pairs for t in c], device=ids.device)
    logprobs = policy.lm_head(hidden[rows, cols]).float().log_softmax(-1)
    picked = logprobs.gather(1, targets[:, None])[:, 0]
    return list(picked.split([len(c) for _, c in pairs]))


def main(iterations: int = 2, n: int = 8, max_tokens: int = 12, lr: float = 3e-5, device: str = "cpu",
         tolerance: float = 1e-4, seed: int = 0, num_prompts: int = len(PROMPTS)) -> dict:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    path = default_model_path()
    phases: list[tuple[str, dict]] = [("start", memory(device))]
    policy = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32).to(device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=lr)
    llm = LLM(path, device=device, dtype="float32", max_model_len=256, seed=seed,
              gpu_memory_utilization=0.3, enable_sleep_mode=True)
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS[:num_prompts]]
    phases.append(("engine built", memory(device)))
    rewards, max_diffs, gains = [], [], []  # gains: advantage-weighted change of the completions' logprob
    try:
        for it in range(iterations):
            # No per-request seed: the engine's seed draws each sample's, so the run is reproducible and the
            # samples of different iterations differ.
            params = SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens, logprobs=0)
            outputs = llm.generate(prompts, params, use_tqdm=False)
            phases.append((f"{it}: rollout", memory(device)))
            llm.sleep(level=2)  # the trainer gets the device: weights and KV cache released
            phases.append((f"{it}: engine asleep", memory(device)))

            policy.train()
            optimizer.zero_grad()
            pairs = [(out.prompt_token_ids, c.token_ids) for out in outputs for c in out.outputs]
            new_logprobs = iter(completion_logprobs(policy, pairs))
            losses, diffs, scores, advantages, before = [], [], [], [], []
            for out in outputs:
                group = [reward(c.text) for c in out.outputs]
                scores += group
                mean, std = statistics.fmean(group), statistics.pstdev(group)
                for c, r in zip(out.outputs, group):
                    new = next(new_logprobs)
                    old = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(c.token_ids)],
                                       device=new.device)
                    diffs.append((new.detach() - old).abs().max().item())
                    advantage = (r - mean) / (std + 1e-4)  # GRPO: rewards normalised within the prompt's group
                    advantages.append(advantage)
                    before.append(new.detach().sum())
                    ratio = (new - old).exp()  # == 1 on-policy; the importance-sampling weight TRL applies
                    losses.append(-(ratio * advantage).mean())
            torch.stack(losses).mean().backward()
            optimizer.step()
            with torch.no_grad():  # did the step move the policy towards the rewarded completions?
                after = [lp.sum() for lp in completion_logprobs(policy, pairs)]
            gains.append(statistics.fmean(a * (x - b).item() for a, x, b in zip(advantages, after, before)))
            rewards.append(statistics.fmean(scores))
            max_diffs.append(max(diffs))
            phases.append((f"{it}: trained", memory(device)))

            llm.wake_up(tags=["weights"])  # allocates the weights; nothing is read from disk
            loaded = llm.load_weights((name, p.detach()) for name, p in policy.named_parameters())
            llm.reset_prefix_cache()  # cached keys and values came from the old weights
            llm.wake_up(tags=["kv_cache"])
            phases.append((f"{it}: weights pushed ({loaded} tensors)", memory(device)))
            print(f"iteration {it}: mean reward {rewards[-1]:.3f}, rollout vs trainer logprobs max |diff| "
                  f"{max_diffs[-1]:.2e}, advantage-weighted logprob gain {gains[-1]:+.4f}")
        final = llm.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens), use_tqdm=False)
        rewards.append(statistics.fmean(reward(c.text) for o in final for c in o.outputs))
    finally:
        report = llm.shutdown()
    phases.append(("engine shut down", memory(device)))
    print("\n| phase | " + " | ".join(f"{k} MiB" for k in phases[0][1]) + " |")
    print("|---|" + "---|" * len(phases[0][1]))
    for name, mem in phases:
        print(f"| {name} | " + " | ".join(f"{v:.0f}" for v in mem.values()) + " |")
    print(f"\nmean reward by iteration (last: after training): {[round(r, 3) for r in rewards]}")
    print(f"shutdown: {report}")
    if max(max_diffs) > tolerance:
        raise SystemExit(f"rollout logprobs differ from the trainer's by {max(max_diffs):.2e} > {tolerance}")
    return {"rewards": rewards, "gains": gains, "max_logprob_diff": max(max_diffs), "phases": phases,
            "clean": report.clean}


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--prompts", type=int, default=len(PROMPTS), help="how many of the prompts to use")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tolerance", type=float, default=None,
                    help="max |rollout - trainer| logprob (default 1e-4 on the CPU, 2e-3 on CUDA: TF32-free fp32 "
                         "kernels still sum in a different order)")
    args = ap.parse_args()
    tol = args.tolerance if args.tolerance is not None else (1e-4 if args.device == "cpu" else 2e-3)
    main(args.iterations, args.n, args.max_tokens, args.lr, args.device, tol, num_prompts=args.prompts)
