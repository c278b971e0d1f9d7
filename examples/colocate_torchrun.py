"""A colocated RL trainer under torchrun: each rank holds its policy and one tensor-parallel slice of the engine.

    torchrun --nproc-per-node 2 --master-port 29511 examples/colocate_torchrun.py [--iterations 2]

This is the shape of TRL's GRPO colocate mode with ``tensor_parallel_size``
above 1 (and of verl's hybrid engine): torchrun starts one process per GPU
(gloo and the CPU where there is none); every process is a data-parallel
trainer rank that holds its own copy of the policy, and together they build
one tidyrun engine with ``distributed_executor_backend="external_launcher"``,
each process holding its slice of the weights and KV cache. Each iteration:

1. every rank rolls out the same prompts with the same sampling params (the
   rule of vLLM's external launcher) and gets the same completions;
2. the engine sleeps (level 1: weights to host memory, KV cache released);
3. each trainer rank takes its share of the completions, computes a
   policy-gradient loss, and the gradients are averaged over the trainer's
   own default process group, which the engine never touches;
4. the engine wakes and every rank pushes its full, updated weights with
   ``load_weights`` (each keeps its slice).

It checks what such a trainer relies on: the ranks sample the same tokens,
the trainer's process group works before, between and after, and shutdown
leaves nothing behind on any rank.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_loop import PROMPTS, completion_logprobs, reward  # noqa: E402 - the reward and the policy's logprobs

from tidyrun import LLM, SamplingParams  # noqa: E402
from tidyrun.loader import default_model_path  # noqa: E402


def same_on_every_rank(value) -> bool:
    """Whether every trainer rank holds an equal ``value`` (compared over the trainer's own group)."""
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return all(v == values[0] for v in values)


def main(iterations: int, n: int, max_tokens: int, lr: float) -> None:
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")  # the trainer's group: torchrun's environment, as any trainer starts
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same initial policy on every rank, as DDP would broadcast it
    path = default_model_path()
    policy = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                  dtype=torch.float32)
    optimizer = torch.optim.SGD(policy.parameters(), lr=lr)
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=32 << 20,
              tensor_parallel_size=world, distributed_executor_backend="external_launcher")
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in PROMPTS]
    try:
        for it in range(iterations):
            outputs = llm.generate(prompts, SamplingParams(n=n, temperature=1.0, max_tokens=max_tokens),
                                   use_tqdm=False)
            tokens = [c.token_ids for o in outputs for c in o.outputs]
            agree = same_on_every_rank(tokens)
            llm.sleep(level=1)  # the trainer's step needs the memory

            mine = [(o, c) for i, o in enumerate(outputs) if i % world == rank for c in o.outputs]
            scores = [reward(c.text) for _, c in mine]
            baseline = statistics.fmean(scores)
            optimizer.zero_grad()
            logprobs = completion_logprobs(policy, [(o.prompt_token_ids, c.token_ids) for o, c in mine])
            loss = -torch.stack([(s - baseline) * lp.sum() for s, lp in zip(scores, logprobs)]).mean()
            loss.backward()
            for p in policy.parameters():  # data parallelism over the trainer's own group
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()

            llm.wake_up()
            loaded = llm.load_weights((name, p.detach()) for name, p in policy.named_parameters())
            policies_equal = same_on_every_rank(policy.lm_head.weight.sum().item())
            if rank == 0:
                mean_reward = statistics.fmean(reward(c.text) for o in outputs for c in o.outputs)
                print(f"iteration {it}: mean reward {mean_reward:.3f}, ranks sampled the same tokens: {agree}, "
                      f"policies equal: {policies_equal}, {loaded} tensors pushed", flush=True)
    finally:
        report = llm.shutdown()
    clean = torch.tensor([float(report.clean)])
    dist.all_reduce(clean)  # the trainer's group still works after the engine is gone
    if rank == 0:
        print(f"shutdown: rank 0: {report}; ranks clean: {int(clean.item())} of {world}")
    dist.destroy_process_group()


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--n", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    args = ap.parse_args()
    main(args.iterations, args.n, args.max_tokens, args.lr)
