"""One rank of an engine started by an external launcher (torchrun, or the tests' own env-variable launch).

    python tests/launched_rank.py SCENARIO MODEL OUT_DIR      (LAUNCHED_DEVICE=cuda: on the launcher's GPUs)

Run by tests/test_launcher.py in every process of a launch; writes what it
saw to OUT_DIR/rank{RANK}.json for the test to compare against a one-process
engine. Scenarios:

- ``lifecycle``: greedy outputs; again after sleep(1)/wake_up; after sleep(2), wake_up(["weights"]),
  collective_rpc("reload_weights"), wake_up(["kv_cache"]); after update_weights with a full tensor and a
  rank's own slice of another; a seeded sampled output; shutdown (and how many references to the trainer's
  default group the shut-down engine keeps); the trainer's default group afterwards.
- ``greedy``: greedy outputs and shutdown.
- ``caller_group``: as ``greedy`` on a group the caller built with torch.distributed.new_group, and how many
  references to it and to the default group the shut-down engine (still held) keeps;
  ``caller_group_bad_start``: there, rank 1 fails to start.
- ``kill``: rank 1 kills itself during its third step; rank 0 records the error and how long it took.
- ``diverge``: the ranks pass different prompts.
- ``bad_start``: rank 1 asks for a context the model does not have (fails before the KV agreement).
- ``late_fail``: rank 1's KV cache allocation fails (simulated), after the ranks agreed on its size.
- ``short_kv``: rank 0 plans too few KV blocks for rank 1's context: every rank refuses the agreed count.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from tidyrun import LLM, SamplingParams
from tidyrun.model.sharding import split_range

PROMPTS = ["The capital of France is", "List three colours:", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def perturbation(hidden: int, intermediate: int) -> dict[str, torch.Tensor]:
    """Full tensors the lifecycle scenario pushes (the test pushes the same into a one-process engine)."""
    gen = torch.Generator().manual_seed(0)
    return {"model.norm.weight": torch.full((hidden,), 1.5),
            "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, intermediate, generator=gen) * 0.02}


def greedy(llm: LLM, prompts=PROMPTS) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def engine(model: str, **kw) -> LLM:
    options = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
                   tensor_parallel_size=2, distributed_executor_backend="external_launcher")
    if os.environ.get("LAUNCHED_DEVICE") == "cuda":  # tests/test_gpu_launcher.py: each rank on cuda:LOCAL_RANK
        options.update(device=None, kernels="torch")
    return LLM(model, **(options | kw))


def lifecycle(model: str, rank: int) -> dict:
    dist.init_process_group("gloo")  # the trainer's own default group, before and after the engine
    out: dict = {}
    before = sys.getrefcount(dist.group.WORLD)
    llm = engine(model)
    out["greedy"] = greedy(llm)
    llm.sleep(1)
    llm.wake_up()
    out["after_sleep"] = greedy(llm)
    llm.sleep(2)
    llm.wake_up(["weights"])
    llm.collective_rpc("reload_weights")
    llm.wake_up(["kv_cache"])
    out["after_reload"] = greedy(llm)
    cfg = llm.runner.model_config
    weights = perturbation(cfg.hidden_size, cfg.intermediate_size)
    start, length = split_range(cfg.intermediate_size, 2, rank)
    down = "model.layers.0.mlp.down_proj.weight"
    llm.load_weights([("model.norm.weight", weights["model.norm.weight"]),
                      (down, weights[down].narrow(1, start, length).clone())])  # this rank's slice only
    out["updated"] = greedy(llm)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=7)
    out["sampled"] = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sampled, use_tqdm=False)]
    report = llm.shutdown()
    out["clean"], out["ranks"] = report.clean, len(report.ranks)
    out["world_refs_kept"] = sys.getrefcount(dist.group.WORLD) - before  # the engine is still held here
    total = torch.ones(1)
    dist.all_reduce(total)
    out["trainer_group_sum"] = total.item()
    out["trainer_world"] = dist.get_world_size()
    dist.destroy_process_group()
    return out


def on_caller_group(run) -> dict:
    """``run(group)`` on a group the caller built; then the group must still be usable, and every rank must have
    joined the same collectives on it (a rank left waiting in one would hang this all-reduce)."""
    dist.init_process_group("gloo")
    group = dist.new_group([0, 1])
    out = run(group)
    total = torch.ones(1)
    dist.all_reduce(total, group=group)
    out["group_sum"] = total.item()
    dist.destroy_process_group()
    return out


def caller_group(model: str, rank: int) -> dict:
    def run(group) -> dict:
        before = sys.getrefcount(group), sys.getrefcount(dist.group.WORLD)
        llm = engine(model, process_group=group)
        out = {"greedy": greedy(llm), "clean": llm.shutdown().clean}
        # The engine, still held (as users hold theirs), must have let go of the groups: one it keeps stays
        # alive past the caller's destroy_process_group, and its gloo threads into interpreter exit.
        out["group_refs_kept"] = sys.getrefcount(group) - before[0]
        out["world_refs_kept"] = sys.getrefcount(dist.group.WORLD) - before[1]
        return out

    return on_caller_group(run)


def caller_group_bad_start(model: str, rank: int) -> dict:
    return on_caller_group(lambda group: bad_start(
        model, rank, {"process_group": group, **({"max_model_len": 10**6} if rank == 1 else {})}))


def kill(model: str, rank: int) -> dict:
    llm = engine(model)
    greedy(llm)  # warm: both ranks up and in step
    if rank == 1:
        steps = 0
        forward = llm.runner.forward_logits

        def dying(*args, **kwargs):
            nonlocal steps
            steps += 1
            if steps == 3:
                os.kill(os.getpid(), signal.SIGKILL)
            return forward(*args, **kwargs)

        llm.runner.forward_logits = dying
    start = time.monotonic()
    out: dict = {}
    try:
        greedy(llm)
        out["error"] = None
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["error"] = f"{type(exc).__name__}: {exc}"
    out["seconds"] = time.monotonic() - start
    try:
        greedy(llm)
        out["again"] = None
    except Exception as exc:  # noqa: BLE001
        out["again"] = type(exc).__name__
    out["clean"] = llm.shutdown().clean
    return out


def diverge(model: str, rank: int) -> dict:
    llm = engine(model)
    try:
        greedy(llm, PROMPTS[rank:rank + 1] * (rank + 1))
        out = {"error": None}
    except Exception as exc:  # noqa: BLE001
        out = {"error": f"{type(exc).__name__}: {exc}"}
    out["clean"] = llm.shutdown().clean
    return out


def bad_start(model: str, rank: int, options: dict | None = None) -> dict:
    if options is None:
        options = {"max_model_len": 10**6} if rank == 1 else {}
    try:
        llm = engine(model, **options)
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {exc}"}
    llm.shutdown()
    return {"error": None}


def late_fail(model: str, rank: int) -> dict:
    if rank == 1:
        from tidyrun.runner import components

        def no_memory(*args, **kwargs):
            raise MemoryError("simulated: no memory for the KV cache")

        components.KVCache = no_memory
    return bad_start(model, rank, {})


def short_kv(model: str, rank: int) -> dict:
    return bad_start(model, rank, {"kv_cache_memory": 320 << 10} if rank == 0 else {"max_model_len": 512})


SCENARIOS = {"lifecycle": lifecycle, "greedy": lambda m, r: {"greedy": greedy(llm := engine(m)),
                                                             "clean": llm.shutdown().clean},
             "caller_group": caller_group, "kill": kill, "diverge": diverge, "bad_start": bad_start,
             "late_fail": late_fail, "short_kv": short_kv, "caller_group_bad_start": caller_group_bad_start}

if __name__ == "__main__":
    scenario, model, out_dir = sys.argv[1:4]
    rank = int(os.environ["RANK"])
    result = SCENARIOS[scenario](model, rank)
    with open(os.path.join(out_dir, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.rename(os.path.join(out_dir, f"rank{rank}.json.tmp"), os.path.join(out_dir, f"rank{rank}.json"))
    if rank == 0 and "TORCHELASTIC_USE_AGENT_STORE" not in os.environ:
        # Without torchrun's agent this process hosts the launcher's store, which the other engines' ranks
        # (past this engine's 2) may still need to start: like a trainer's rank 0, it lives until they are
        # done (the README's limit). Found when ranks 2-3 of a 4-process launch lagged on a loaded machine.
        others = range(2, int(os.environ["WORLD_SIZE"]))
        deadline = time.monotonic() + 600
        while (time.monotonic() < deadline
               and not all(os.path.exists(os.path.join(out_dir, f"rank{r}.json")) for r in others)):
            time.sleep(0.2)
