"""On the CPU: the Triton kernels run under Triton's interpreter and equal the torch references (fp32).

Runs in a subprocess because TRITON_INTERPRET must be set before Triton
compiles anything in the process. Skipped where Triton is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

SCRIPT = """
import torch, kernel_checks as kc
kc.check_padding_rows("cpu", torch.float32)
kc.check_padding_rows("cpu", torch.float32, splits=4)
kc.check_attention_invariance("cpu", torch.float32, atol=1e-6)  # numpy's dots: bits only on the GPU
kc.check_fused("cpu", torch.float32, kc.FUSED_SHAPES)
kc.check_attention("cpu", torch.float32, kc.ATTENTION_CASES, atol=1e-4)
kc.check_attention("cpu", torch.float32, kc.WINDOW_CASES, atol=1e-4, windows=(1, 5, 40))
kc.check_linear("cpu", torch.float32, kc.LINEAR_SHAPES, [(16, 64, 1, 2), (32, 64, 4, 2)], exact=False)
kc.check_race("cpu", torch.float32)
kc.check_masked_race("cpu", torch.float32)
kc.check_race_keyed("cpu", torch.float32)
kc.check_take_pending("cpu")
kc.check_moe("cpu", torch.float32, kc.MOE_CASES)
print("kernels ok")
"""


def interpreter_env() -> dict:
    here = os.path.dirname(__file__)
    path = [here, os.path.dirname(here)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    # One thread each: the three scripts run side by side (``scripts``), and the interpreter's time is Python's.
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")


_TESTS = {"kernels": "test_kernels_under_interpreter", "engine": "test_engine_triton_path_under_interpreter",
          "async": "test_async_scheduling_triton_path_under_interpreter"}


@pytest.fixture(scope="module")
def scripts(request, tmp_path_factory):
    """The module's interpreter scripts that the session selected, started together as separate processes:
    each is one Python thread interpreting kernels for minutes, so side by side they take about the
    longest one's time instead of the sum (the suite's two slowest tests, ~3 minutes each). Output goes
    to files (a pipe nobody reads yet could fill and stall a script). Each test waits for its own."""
    selected = {item.name for item in request.session.items}
    sources = {"kernels": (SCRIPT, []), "engine": (ENGINE_SCRIPT, ["ckpt"]), "async": (ASYNC_SCRIPT, ["ckpt"])}
    launched = {}
    for name, (source, args) in sources.items():
        if _TESTS[name] not in selected:
            continue
        folder = tmp_path_factory.mktemp(name)
        out, err = open(folder / "stdout", "w+"), open(folder / "stderr", "w+")
        proc = subprocess.Popen([sys.executable, "-c", source, *[str(folder / a) for a in args]],
                                env=interpreter_env(), text=True, stdout=out, stderr=err)
        launched[name] = (proc, out, err)
    yield launched
    for proc, out, err in launched.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        out.close()
        err.close()


def finished(scripts, name: str, timeout: float) -> str:
    """The script's stdout once it has ended (its whole output in the failure message otherwise)."""
    proc, out, err = scripts[name]
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    out.seek(0)
    err.seek(0)
    stdout = out.read()
    assert proc.returncode == 0, stdout + err.read()
    return stdout


def test_kernels_under_interpreter(scripts):
    assert "kernels ok" in finished(scripts, "kernels", 600)


# Decode steps split each sequence's keys over programs until ~16 run (the engine aims at 256 on a GPU: 16-way
# splits of a few keys each, most of them empty). The interpreter runs programs one by one, so the engine's
# target made attention more than half of each script's time; two-way splits still run the split path and its
# combine, and the kernel script checks 4-way splits against the reference (both scripts below).
FEW_SPLITS = """
import tidyrun.runner.input_batch as input_batch
_tile_splits, splits_used = input_batch.tile_splits, set()

def few_splits(seqs, heads, block_q, invariant=False):
    splits = _tile_splits(seqs, heads, block_q, invariant, target_programs=16)
    splits_used.add(splits)
    return splits

input_batch.tile_splits = few_splits
"""

# CUDA graphs cannot be captured on the CPU: each "graph" runs eagerly on the graph's own input layout and
# metadata, which checks everything a replay reads (both scripts below).
GRAPH_EMULATION = """
def capture(self, model, kv_cache, ctx, warm_up=True):
    for key in self.keys:
        self._metas[key] = self._metadata(*key)
        self._graphs[key] = (model, kv_cache, ctx)
    return 0.0

def replay(self, key):
    model, kv_cache, ctx = self._graphs[key]
    with ctx.scope(self._metas[key]):
        return self._run(model, key, kv_cache)

CudaGraphManager.capture, CudaGraphManager.replay = capture, replay
"""


ENGINE_SCRIPT = """
import sys
from tidyrun import LLM, SamplingParams
from tidyrun.model.ops import TritonOps
from tidyrun.runner.cuda_graphs import CudaGraphManager
from tidyrun.runner.model_runner import ModelRunner
from tidyrun.synthetic import write_random_checkpoint
""" + FEW_SPLITS + """
ckpt = write_random_checkpoint(sys.argv[1], "llama-tiny", device="cpu")
shared = "the quick brown fox jumps over the lazy dog " * 3
prompts = [shared + "and runs", shared + "and sleeps", "a", "def main():\\n    print('hello world')\\n" * 2]
greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}

def run(**kw):
    # Small token budget: prompts are chunked and mixed with decodes; the shared prefix hits the prefix cache.
    with LLM(ckpt, device="cpu", dtype="float32", max_num_batched_tokens=24, **kw) as llm:
        first = llm.generate(prompts[:1], greedy, use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in first + llm.generate(prompts, greedy, use_tqdm=False)]
        return tokens, llm.compute_logits(shared * 2)  # one step longer than the token budget

reference, logits = run()
ModelRunner._choose_ops = lambda self, config: TritonOps(  # the CUDA path on the CPU
    num_sms=4, ctx=self.ctx, float32_kernels=True, batch_invariant=config.batch_invariant)
tokens, triton_logits = run()
assert tokens == reference, "Triton path differs from the torch path"
assert (triton_logits - logits).abs().max() < 1e-3, "compute_logits differs"
assert run(speculative=spec)[0] == reference, "Triton path with speculation differs"
# Every product through the kernel, keys never split: it runs (the interpreter's numpy dots cannot show the bits).
assert run(batch_invariant=True)[0] == reference, "batch-invariant Triton path differs"

# CUDA graphs cannot be captured on the CPU; running each "graph" eagerly on the graph's own input layout
# and metadata checks everything a replay reads: padded decode batches and padded draft-verification batches.
""" + GRAPH_EMULATION + """ModelRunner._graph_sizes = lambda self, config: {1: (1, 2, 4, 8), 4: (1, 2, 4, 8)}
replays = []
real_replay = CudaGraphManager.replay
CudaGraphManager.replay = lambda self, key: replays.append(key) or real_replay(self, key)
assert run()[0] == reference, "graph layout (decode) differs"
assert run(speculative=spec)[0] == reference, "graph layout (draft verification) differs"
assert any(q == 1 for _, q in replays) and any(q == 4 for _, q in replays), replays
assert max(splits_used) > 1, splits_used  # the split path and its combine ran
print("engine ok")
"""


def test_engine_triton_path_under_interpreter(scripts):
    """The whole Triton step (packed inputs, tiles, fused kernels) gives the torch path's greedy tokens."""
    assert "engine ok" in finished(scripts, "engine", 900)


ASYNC_SCRIPT = """
import sys
from tidyrun import LLM, SamplingParams
from tidyrun.model.ops import TritonOps
from tidyrun.runner.cuda_graphs import CudaGraphManager
from tidyrun.runner.model_runner import ModelRunner
from tidyrun.synthetic import write_random_checkpoint
""" + FEW_SPLITS + """
ckpt = write_random_checkpoint(sys.argv[1], "llama-tiny", device="cpu")
prompts = ["the quick brown fox jumps over the lazy dog " * 3 + "and runs", "a", "def main():\\n    print('hi')\\n" * 2]
params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 4, 7)]
def sampled(seed, n=9, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=n, ignore_eos=True, **kw)
rollout = [SamplingParams(temperature=t, seed=5, max_tokens=6, ignore_eos=True, logprobs=0) for t in (0, 1.0)]
# Penalties: the forward launched ahead, the step sampled after the step before is booked (launch(defer=True)).
penalised = [SamplingParams(temperature=0, max_tokens=7, ignore_eos=True, repetition_penalty=1.5),
             sampled(11, 5, repetition_penalty=1.5)]
GREEDY = [0, 1, 2, 5, 7]  # the rows of run()'s outputs that are greedy

def run(**kw):
    with LLM(ckpt, device="cpu", dtype="float32", max_num_batched_tokens=24, **kw) as llm:
        out = llm.generate(prompts, params, use_tqdm=False) + llm.generate(prompts[:2], sampled(3), use_tqdm=False)
        out += llm.generate(prompts[:2], rollout, use_tqdm=False)  # RL records, launched ahead too
        out += llm.generate(prompts[:2], penalised, use_tqdm=False)
        # A seeded request alone, then among others (one asks logprobs=0: the race's logprob pass for all).
        out += llm.generate(prompts[1:2], sampled(7, 4), use_tqdm=False)
        out += llm.generate(prompts, [sampled(3, 4, logprobs=0), sampled(7, 4), sampled(5, 4)], use_tqdm=False)
        tokens = [o.outputs[0].token_ids for o in out]
        assert tokens[9] == tokens[11], "a seeded draw depends on the batch or on the logprob pass"
        return tokens, [v.logprob for o in out if o.outputs[0].logprobs for d in o.outputs[0].logprobs for v in d.values()]

reference, reference_logprobs = run()
ModelRunner._choose_ops = lambda self, config: TritonOps(num_sms=4, ctx=self.ctx, float32_kernels=True)
# Graphs run eagerly on their own input layout (as in the engine test above): decode steps take their
# pending tokens into the padded graph inputs, prefill chunks run eager.
""" + GRAPH_EMULATION + """ModelRunner._graph_sizes = lambda self, config: {1: (1, 2, 4)}
# The Triton race draws a sampled row's noise from its key (seed, token index), not from its generator:
# its greedy rows are the torch path's, its sampled rows its own synchronous run's.
synced, synced_logprobs = run()
assert [synced[i] for i in GREEDY] == [reference[i] for i in GREEDY], "the Triton path's greedy tokens differ"
assert synced != reference
launched = []
real_launch = ModelRunner.launch
ModelRunner.launch = lambda self, batch, after, **kw: launched.append(after is not None) or real_launch(self, batch, after, **kw)
deferred = []
real_sample = ModelRunner.sample_launched
ModelRunner.sample_launched = lambda self, step: deferred.append(step.tokens is None) or real_sample(self, step)
tokens, logprobs = run(async_scheduling=True)
assert tokens == synced, "async scheduling on the Triton path differs"
assert len(logprobs) == len(synced_logprobs) == len(reference_logprobs) == 16, logprobs
assert max(abs(a - b) for a, b in zip(logprobs, synced_logprobs)) <= 1e-4, (logprobs, synced_logprobs)
assert sum(launched) > 10, launched  # steps ran ahead, feeding each other on the device
assert sum(deferred) >= 5, deferred  # the penalised steps were sampled after booking
assert max(splits_used) > 1, splits_used  # the split path and its combine ran
print("async ok")
"""


def test_async_scheduling_triton_path_under_interpreter(scripts):
    """Async scheduling on the Triton path (pending tokens taken by the kernel, tokens back through the
    pinned slots, graph input layouts, sampled rows keyed by their token's index, deferred steps too): the
    synchronous Triton path's tokens and logprobs; greedy rows the torch path's; a seeded request draws the
    same tokens alone and batched."""
    assert "async ok" in finished(scripts, "async", 900)


def test_invariant_block_rule_takes_the_narrow_products_of_17_to_128_rows():
    """Batch-invariant products of 17-128 rows run the few-row launch in 16-row blocks where the weight's grid is
    narrow (the 1.2B shape's o, down, QKV on 132 SMs); the gated gate/up, the LM head (2004 programs), <= 16 or
    > 128 rows and the default mode keep the row count's own launch."""
    import torch

    from tidyrun.kernels import linear as lin
    from tidyrun.model.ops import TritonOps

    def rule(ops, rows, n, k):
        plan = lin.narrow_plan(n, k, 132) or lin.wide_plan(n, k, 132)
        return ops._split_grid(torch.empty(rows, k, device="meta"), torch.empty(n, k, device="meta"), plan)

    ops = TritonOps(num_sms=132, batch_invariant=True)
    for n, k in ((2048, 2048), (2048, 8192), (3072, 2048)):  # o, down, QKV
        assert [rule(ops, rows, n, k) for rows in (16, 17, 64, 128, 129)] == [None, True, True, True, None]
    assert rule(ops, 64, 128256, 2048) is None  # the LM head
    assert rule(TritonOps(num_sms=132), 64, 2048, 8192) is None  # default mode: cuBLAS picks
