"""Ranks started by an external launcher (distributed_executor_backend="external_launcher"), CPU and gloo.

Every launch runs tests/launched_rank.py in each process: under torchrun
(one node with 2 processes; two torchrun invocations as 2 nodes on loopback),
or as plain processes given torchrun's environment variables (any launcher
that sets RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT; then rank 0 hosts the
store). The ranks' outputs are compared with each other and with a
one-process engine.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

from tidyrun import LLM, SamplingParams
from tidyrun.synthetic import write_random_checkpoint

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "launched_rank.py")
sys.path.insert(0, HERE)
from launched_rank import GREEDY, PROMPTS, perturbation  # noqa: E402

# 3 KV heads split 2 + 1, 301 intermediate channels, 1001 vocabulary rows: every split uneven over 2 ranks.
UNEVEN = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=3,
              intermediate_size=301, vocab_size=1001, max_position_embeddings=512, tie_word_embeddings=False,
              rope_theta=10000.0)
TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                             "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1", "TQDM_DISABLE": "1",
            "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), env.get("PYTHONPATH", "")])}


def results(out_dir, world: int = 2) -> list[dict | None]:
    found = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        found.append(json.load(open(path)) if os.path.exists(path) else None)
    return found


def torchrun(scenario: str, model: str, out_dir, nodes: int = 1) -> list[dict]:
    """2 ranks: one torchrun with 2 processes, or ``nodes`` = 2 torchrun invocations of one process each."""
    port = free_port()
    common = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    if nodes == 1:
        commands = [common + ["--nproc-per-node", "2"]]
    else:
        commands = [common + ["--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1"] for n in range(2)]
    procs = [subprocess.Popen([*c, SCRIPT, scenario, model, str(out_dir)], env=child_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for c in commands]
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return results(out_dir)


def env_launch(scenario: str, model: str, out_dir, world: int = 2) -> tuple[list[dict | None], list[int], list[str]]:
    """Plain processes given the launcher's environment variables (no torchrun agent: rank 0 hosts the store)."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, SCRIPT, scenario, model, str(out_dir)],
                              env={**child_env(), "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r),
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    logs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    return results(out_dir, world), [p.returncode for p in procs], logs


def one_process(model: str) -> LLM:
    return LLM(model, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=16 << 20)


def greedy(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def uneven_dir(tmp_path_factory) -> str:
    return write_random_checkpoint(str(tmp_path_factory.mktemp("uneven")), UNEVEN, dtype=torch.float32, std=0.1)


def test_torchrun_ranks_equal_one_process_through_sleep_reload_and_weight_updates(llm, default_model, tmp_path):
    """torchrun --nproc-per-node 2 on the default model: both ranks give the one-process engine's greedy tokens,
    still after sleep/wake, a level-2 sleep refilled by reload_weights, and pushed weights (a full tensor, and
    each rank's own slice of another); seeded samples agree; shutdown is clean on both ranks; the trainer's
    default group is usable afterwards."""
    ranks = torchrun("lifecycle", default_model, tmp_path)
    expected = greedy(llm)
    cfg = llm.runner.model_config
    try:
        llm.load_weights(perturbation(cfg.hidden_size, cfg.intermediate_size).items())
        updated = greedy(llm)
    finally:
        llm.collective_rpc("reload_weights")  # the shared engine gets its own weights back
    assert ranks[0] == ranks[1]
    out = ranks[0]
    assert out["greedy"] == out["after_sleep"] == out["after_reload"] == expected
    assert out["updated"] == updated != expected
    assert all(len(t) == 16 for t in out["sampled"]) and out["sampled"] != out["greedy"]
    assert out["clean"] and out["ranks"] == 1
    assert [r["world_refs_kept"] for r in ranks] == [0, 0]  # the trainer's group dies when the trainer ends it
    assert out["trainer_group_sum"] == 2.0 and out["trainer_world"] == 2


def test_two_torchrun_nodes_on_loopback_equal_one_process(llm, default_model, tmp_path):
    """torchrun --nnodes 2 (one process per node, two invocations): the ranks meet through the launcher's store."""
    ranks = torchrun("greedy", default_model, tmp_path, nodes=2)
    assert ranks[0]["greedy"] == ranks[1]["greedy"] == greedy(llm)
    assert ranks[0]["clean"] and ranks[1]["clean"]


def test_a_caller_given_group_runs_the_engine_and_stays_the_callers(uneven_dir, tmp_path):
    ranks, codes, logs = env_launch("caller_group", uneven_dir, tmp_path)
    assert codes == [0, 0], "\n".join(logs)
    single = one_process(uneven_dir)
    try:
        expected = greedy(single)
    finally:
        single.shutdown()
    assert ranks[0]["greedy"] == ranks[1]["greedy"] == expected
    assert all(r["clean"] and r["group_sum"] == 2.0 for r in ranks)
    assert [(r["group_refs_kept"], r["world_refs_kept"]) for r in ranks] == [(0, 0), (0, 0)]


def test_a_rank_failing_to_start_on_a_caller_given_group_leaves_the_group_in_step(uneven_dir, tmp_path):
    ranks, codes, logs = env_launch("caller_group_bad_start", uneven_dir, tmp_path)
    assert codes == [0, 0], "\n".join(logs)
    assert ranks[1]["error"].startswith("InvalidRequestError: max_model_len=1000000 exceeds"), ranks[1]
    assert ranks[0]["error"].startswith("WorkerError: tensor-parallel rank(s) [1] of the caller's process group "
                                        "failed to start"), ranks[0]
    assert ranks[0]["group_sum"] == ranks[1]["group_sum"] == 2.0  # no vote left hanging on the caller's group


def test_four_processes_form_two_engines_of_two_ranks(uneven_dir, tmp_path):
    """WORLD_SIZE=4 with tensor_parallel_size=2: ranks {0, 1} and {2, 3} each form an engine (data parallelism
    over tensor-parallel engines, as a trainer with 4 GPUs and TP 2 runs), on one store, without crossing."""
    ranks, codes, logs = env_launch("greedy", uneven_dir, tmp_path, world=4)
    assert codes == [0] * 4, "\n".join(logs)
    assert all(r["greedy"] == ranks[0]["greedy"] and r["clean"] for r in ranks)


def test_a_rank_killed_mid_generate_is_a_clear_error_on_the_other(uneven_dir, tmp_path):
    ranks, codes, logs = env_launch("kill", uneven_dir, tmp_path)
    assert codes[1] == -9 and codes[0] == 0, "\n".join(logs)
    survivor = ranks[0]
    assert survivor["error"].startswith("WorkerError: tensor-parallel rank 0 of 2 stopped: a step failed"), survivor
    assert survivor["seconds"] < 30, survivor  # gloo sees the closed connection: no wait for the timeout
    assert survivor["again"] == "WorkerError" and survivor["clean"]


def test_ranks_making_different_calls_fail_instead_of_hanging(uneven_dir, tmp_path):
    ranks, codes, logs = env_launch("diverge", uneven_dir, tmp_path)
    assert codes == [0, 0], "\n".join(logs)
    for r in ranks:
        assert "the ranks' steps differ (rank 0: 5 tokens, rank 1: 30 tokens)" in r["error"], r
        assert "every rank must make the same calls" in r["error"] and r["clean"]


@pytest.mark.parametrize("scenario, cause", [
    ("bad_start", "InvalidRequestError: max_model_len=1000000 exceeds"),  # before the KV agreement
    ("late_fail", "MemoryError: simulated: no memory for the KV cache"),  # after it, before the rendezvous
])
def test_a_rank_that_fails_to_start_is_named_by_the_others(uneven_dir, tmp_path, scenario, cause):
    ranks, codes, logs = env_launch(scenario, uneven_dir, tmp_path)
    assert codes == [0, 0], "\n".join(logs)
    assert ranks[1]["error"].startswith(cause), ranks[1]
    assert ranks[0]["error"].startswith(f"WorkerError: tensor-parallel rank 1 (launcher RANK 1) failed to start: "
                                        f"{cause}"), ranks[0]


def test_a_kv_cache_too_small_for_another_ranks_context_is_refused_on_every_rank(uneven_dir, tmp_path):
    ranks, codes, logs = env_launch("short_kv", uneven_dir, tmp_path)
    assert codes == [0, 0], "\n".join(logs)
    assert ranks[0] == ranks[1], ranks
    assert ranks[0]["error"].startswith("OutOfResourcesError: the tensor-parallel ranks agreed on 20 KV blocks "
                                        "(320 tokens), fewer than one sequence of rank 1's max_model_len needs "
                                        "(32 blocks)"), ranks[0]


def test_a_rank_slice_is_taken_only_where_asked():
    """A tensor shaped as this rank's slice loads only with full_only=False (weights pushed to a launched rank),
    never from a checkpoint; a slice of transformers' stacked experts splits into this rank's gate and up."""
    from tidyrun.loader.hf import config_from_hf
    from tidyrun.model.registry import skeleton
    from tidyrun.model.sharding import TPShard
    from tidyrun.errors import ModelLoadError

    dense = config_from_hf({"model_type": "llama", **UNEVEN}, "test")
    model = skeleton(dense, TPShard.of(dense, 1, 2))
    down = [("model.layers.0.mlp.down_proj.weight", torch.zeros(192, 150))]  # rank 1's 150 of 301 channels
    with pytest.raises(ModelLoadError, match=r"has shape \(192, 150\), expected \(192, 301\)$"):
        model.check_weights(down, require_all=False)
    model.check_weights(down, require_all=False, full_only=False)
    with pytest.raises(ModelLoadError, match=r"expected \(192, 301\) \(or this rank's slice, \(192, 150\)\)"):
        model.check_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(192, 151))], False, False)

    moe = config_from_hf({"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 1,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                          "intermediate_size": 96, "moe_intermediate_size": 48, "num_experts": 4,
                          "num_experts_per_tok": 2, "vocab_size": 128, "max_position_embeddings": 64}, "test")
    model = skeleton(moe, TPShard.of(moe, 1, 2))
    stacked = torch.arange(4 * 48 * 64, dtype=torch.float32).reshape(4, 48, 64)  # [E, gate 24 + up 24, H]
    pairs = dict(model.checkpoint_names([("model.layers.0.mlp.experts.gate_up_proj", stacked)]))
    gate, up = (pairs[f"model.layers.0.mlp.experts.2.{n}_proj.weight"] for n in ("gate", "up"))
    assert torch.equal(gate, stacked[2, :24]) and torch.equal(up, stacked[2, 24:])
    model.check_weights(pairs.items(), require_all=False, full_only=False)


def test_spawned_ranks_refuse_a_rank_slice(uneven_dir):
    """A driver sends full tensors to its workers: a slice given to it would reach the wrong rank, so it is refused
    (a launched rank takes its own slice: the torchrun test above pushes one)."""
    from tidyrun import InvalidRequestError

    with LLM(uneven_dir, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory=16 << 20,
             tensor_parallel_size=2) as llm:
        with pytest.raises(InvalidRequestError, match=r"down_proj.weight' has shape \(192, 151\), expected "
                                                      r"\(192, 301\)$"):
            llm.load_weights([("model.layers.0.mlp.down_proj.weight", torch.zeros(192, 151))])
        assert greedy(llm)  # nothing was sent; the ranks are still in step
