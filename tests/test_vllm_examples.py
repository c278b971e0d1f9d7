"""User programs shaped like vLLM's offline-inference examples run on tidyrun with only the import changed.

Each program below is what a vLLM user writes (basic generation, an engine built from CLI keyword arguments,
chat, seeded reproducibility, prefix caching, metrics, profiling); every call in it is vLLM's API and the one tidyrun-specific line
is ``from tidyrun import ...``. The model is named by its Hugging Face id, resolved from a fake local HF cache
(HF_HOME in a tmp dir) holding the bundled GGUF file. To keep CPU time low the programs run in one fresh
interpreter, one after another as ``__main__`` (runpy), each building its own engines as it would alone; the
tests assert on what they print.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import textwrap

import pytest

from tidyrun.loader import default_model_path

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SNAPSHOT = "5f6e7d8c9b0a1f2e3d4c5b6a79881726354d4c3b"

PROGRAMS = {
    "basic": '''
        """Complete a few prompts with nucleus sampling and show what came back."""
        from tidyrun import LLM, SamplingParams

        prompts = [
            "My favourite season of the year is",
            "A good breakfast should include",
            "The tallest mountain in the world is",
        ]
        sampling_params = SamplingParams(temperature=0.8, top_p=0.95)


        def main():
            llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512)
            outputs = llm.generate(prompts, sampling_params)
            print("=" * 50)
            for output in outputs:
                print(f"Prompt: {output.prompt!r}")
                print(f"Output: {output.outputs[0].text!r}")
                print("=" * 50)


        if __name__ == "__main__":
            main()
    ''',
    "generate": '''
        """vLLM's basic/generate.py: every engine option from the command line (EngineArgs), the rest sampling."""
        from tidyrun import LLM, EngineArgs
        from tidyrun.utils import FlexibleArgumentParser


        def create_parser():
            parser = FlexibleArgumentParser()
            # Add engine args
            EngineArgs.add_cli_args(parser)
            parser.set_defaults(model="HuggingFaceTB/SmolLM2-135M-Instruct")
            # Add sampling params
            sampling_group = parser.add_argument_group("Sampling parameters")
            sampling_group.add_argument("--max-tokens", type=int)
            sampling_group.add_argument("--temperature", type=float)
            sampling_group.add_argument("--top-p", type=float)
            sampling_group.add_argument("--top-k", type=int)
            return parser


        def main(args: dict):
            # Pop arguments not used by LLM
            max_tokens = args.pop("max_tokens")
            temperature = args.pop("temperature")
            top_p = args.pop("top_p")
            top_k = args.pop("top_k")

            # Create an LLM
            llm = LLM(**args)

            # Create a sampling params object
            sampling_params = llm.get_default_sampling_params()
            if max_tokens is not None:
                sampling_params.max_tokens = max_tokens
            if temperature is not None:
                sampling_params.temperature = temperature
            if top_p is not None:
                sampling_params.top_p = top_p
            if top_k is not None:
                sampling_params.top_k = top_k

            prompts = ["Three things to pack for a hike:", "The best way to learn a language is"]
            outputs = llm.generate(prompts, sampling_params)
            print("-" * 50)
            for output in outputs:
                completion = output.outputs[0]
                print(f"Prompt: {output.prompt!r}")
                print(f"Output: {completion.text!r}")
                print(f"Tokens: {len(completion.token_ids)}")
                print("-" * 50)


        if __name__ == "__main__":
            parser = create_parser()
            args: dict = vars(parser.parse_args())
            main(args)
    ''',
    "chat": '''
        """Chat with the model: one conversation, then several at once, with the model's own chat template."""
        import sys

        from tidyrun import LLM, SamplingParams


        def print_outputs(outputs):
            for output in outputs:
                print(f"Prompt: {output.prompt!r}")
                print(f"Generated text: {output.outputs[0].text!r}")
            print("-" * 60)


        def print_rendered(llm, outputs):
            # What the chat template made of each conversation: the prompt tokens, decoded.
            tokenizer = llm.get_tokenizer()
            for output in outputs:
                print(f"Rendered: {tokenizer.decode(output.prompt_token_ids)!r}")


        def main(chat_template_path=None):
            llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512)
            sampling_params = SamplingParams(temperature=0.5, max_tokens=8)

            conversation = [
                {"role": "system", "content": "You are a concise assistant for a gardening shop."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello! How can I help with your garden today?"},
                {"role": "user", "content": "Which vegetable is easiest to grow on a balcony?"},
            ]
            outputs = llm.chat(conversation, sampling_params, use_tqdm=False)
            print_outputs(outputs)
            print_rendered(llm, outputs)

            # Several conversations in one call; a template file replaces the model's template if given.
            conversations = [conversation, [{"role": "user", "content": "Name one herb that grows in shade."}]]
            chat_template = None
            if chat_template_path is not None:
                with open(chat_template_path) as f:
                    chat_template = f.read()
            outputs = llm.chat(conversations, sampling_params, use_tqdm=False, chat_template=chat_template)
            print_outputs(outputs)
            print_rendered(llm, outputs)


        if __name__ == "__main__":
            main(sys.argv[1] if len(sys.argv) > 1 else None)
    ''',
    "reproducibility": '''
        """Seeded sampling: the same engine seed gives the same samples, and so does a request's own seed."""
        import gc
        import os

        # vLLM: run the engine in this process so that the seed governs all its sampling.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

        from tidyrun import LLM, SamplingParams

        MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
        prompts = ["Once upon a time, a small robot", "The secret ingredient in my soup is"]
        sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)


        def sample(run):
            llm = LLM(model=MODEL, seed=42, max_model_len=512)
            for output in llm.generate(prompts, sampling_params, use_tqdm=False):
                print(f"run {run}: {output.prompt!r} -> {output.outputs[0].text!r}")
            return llm


        def main():
            llm = sample(1)
            del llm  # shut the first engine down before starting the second
            gc.collect()
            llm = sample(2)

            # A request with its own seed samples the same tokens whatever else shares its batch.
            seeded = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8, seed=1234)
            other = SamplingParams(temperature=1.0, max_tokens=8)
            alone = llm.generate(["The ocean at night"], seeded, use_tqdm=False)
            batched = llm.generate(["Tell me a joke about cats.", "The ocean at night", "Why is the sky blue?"],
                                   [other, seeded, other], use_tqdm=False)
            print(f"seeded alone: {alone[0].outputs[0].text!r}")
            print(f"seeded in a batch: {batched[1].outputs[0].text!r}")


        if __name__ == "__main__":
            main()
    ''',
    "prefix_caching": '''
        """Prompts sharing a long prefix: a prefix-caching engine reuses it and answers exactly as one without."""
        import gc

        from tidyrun import LLM, SamplingParams

        MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
        shared_prefix = (
            "You are the front desk of a small town library. The library opens at nine in the morning and "
            "closes at six in the evening on weekdays; on Saturdays it closes at one and on Sundays it stays "
            "shut. Members may borrow up to five books for three weeks and renew them twice, unless another "
            "member has reserved them. Late returns cost ten cents per book per day. Answer in a few words. "
        )
        questions = [
            "Question: When does the library close on Saturday? Answer:",
            "Question: How many books may a member borrow? Answer:",
            "Question: What does a late book cost per day? Answer:",
        ]
        prompts = [shared_prefix + question for question in questions]
        sampling_params = SamplingParams(temperature=0.0, max_tokens=8)


        def main():
            regular_llm = LLM(model=MODEL, max_model_len=512, enable_prefix_caching=False)
            regular_texts = [o.outputs[0].text for o in regular_llm.generate(prompts, sampling_params)]
            for question, text in zip(questions, regular_texts):
                print(f"without cache: {question!r} -> {text!r}")
            del regular_llm
            gc.collect()

            cached_llm = LLM(model=MODEL, max_model_len=512, enable_prefix_caching=True)
            cached_llm.generate(prompts[0], sampling_params)  # warm-up: fills the cache with the prefix
            outputs = cached_llm.generate(prompts, sampling_params)
            cached_texts = [o.outputs[0].text for o in outputs]
            for question, output in zip(questions, outputs):
                print(f"with cache: {question!r} -> {output.outputs[0].text!r} "
                      f"(cached prompt tokens: {output.num_cached_tokens})")
            print(f"Same answers: {regular_texts == cached_texts}")


        if __name__ == "__main__":
            main()
    ''',
    "metrics": '''
        """vLLM's offline metrics example: generate, then read the engine's metrics by kind."""
        from tidyrun import LLM, SamplingParams
        from tidyrun.v1.metrics.reader import Counter, Gauge, Histogram, Vector

        prompts = ["The quick brown fox", "Once upon a time", "The three primary colours are"]
        sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=8)


        def main():
            llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512, disable_log_stats=False)
            llm.generate(prompts, sampling_params)
            for metric in llm.get_metrics():
                if isinstance(metric, Gauge):
                    print(f"{metric.name} (gauge) = {metric.value}")
                elif isinstance(metric, Counter):
                    print(f"{metric.name} (counter) = {metric.value}")
                elif isinstance(metric, Vector):
                    print(f"{metric.name} (vector) = {metric.values}")
                elif isinstance(metric, Histogram):
                    print(f"{metric.name} (histogram) sum = {metric.sum} count = {metric.count}")


        if __name__ == "__main__":
            main()
    ''',
    "profiling": '''
        """vLLM's simple_profiling example: a torch profiler trace of one generate() call."""
        import os

        from tidyrun import LLM, SamplingParams

        prompts = ["Hello, my name is", "The capital of France is"]
        sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=4)


        def main():
            llm = LLM(model="HuggingFaceTB/SmolLM2-135M-Instruct", max_model_len=512,
                      profiler_config={"profiler": "torch", "torch_profiler_dir": "./vllm_profile"})
            llm.start_profile()
            outputs = llm.generate(prompts, sampling_params)
            llm.stop_profile()
            for output in outputs:
                print(f"Prompt: {output.prompt!r}, Generated text: {output.outputs[0].text!r}")
            print(f"Traces: {sorted(os.listdir('./vllm_profile'))!r}")


        if __name__ == "__main__":
            main()
    ''',
}

# Arguments as a user passes them on the command line (vLLM's EngineArgs options for "generate").
ARGS = {
    "generate": ["--dtype", "auto", "--max_model_len", "512", "--seed=7", "--enforce-eager",
                 "--gpu-memory-utilization", "0.5", "--max-tokens", "8", "--temperature", "0.7", "--top-p", "0.9",
                 "--top-k", "20"],
}

# Runs each program as __main__ in this one interpreter, as `python prog.py args...` would; a failing program is
# reported in its section and the next one still runs.
DRIVER = '''
import gc, os, runpy, sys, time, traceback
for spec in sys.argv[1:]:
    path, *args = spec.split("::")
    name = os.path.basename(path)[:-3]
    print(f"##### {name}", flush=True)
    sys.argv, start = [path, *args], time.perf_counter()
    try:
        runpy.run_path(path, run_name="__main__")
    except BaseException:
        print(f"##### {name} FAILED")
        traceback.print_exc(file=sys.stdout)
    gc.collect()
    sys.stdout.flush()
    print(f"{name}: {time.perf_counter() - start:.1f}s", file=sys.stderr)
'''


def write_fake_hf_cache(root: str) -> None:
    """HF_HOME ``root`` whose hub cache holds the bundled GGUF file as MODEL_ID's main revision."""
    gguf = default_model_path()
    repo = os.path.join(root, "hub", "models--" + MODEL_ID.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", SNAPSHOT)
    os.makedirs(snapshot)
    os.symlink(gguf, os.path.join(snapshot, os.path.basename(gguf)))
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(SNAPSHOT)


@pytest.fixture(scope="module")
def printed(tmp_path_factory) -> dict[str, str]:
    """Each program's printed output, by name (all run once, in one fresh interpreter)."""
    root = tmp_path_factory.mktemp("vllm_examples")
    hf_home = str(root / "hf_home")
    write_fake_hf_cache(hf_home)
    paths = []
    for name, source in PROGRAMS.items():
        path = root / f"{name}.py"
        path.write_text(textwrap.dedent(source).lstrip())
        paths.append("::".join([str(path), *ARGS.get(name, [])]))
    # No HF_HUB_OFFLINE: resolving an id from the cache must need no network setting.
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_HUB_OFFLINE")}
    env.update(HF_HOME=hf_home, PYTHONPATH=os.pathsep.join(filter(None, [REPO_ROOT, env.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, "-c", DRIVER, *paths], capture_output=True, text=True, env=env,
                          cwd=str(root), timeout=600)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    sections = dict(re.findall(r"^##### (\w+)\n(.*?)(?=^##### \w+\n|\Z)", proc.stdout, re.S | re.M))
    assert list(sections) == list(PROGRAMS), proc.stdout
    return sections


def output_of(printed: dict[str, str], name: str) -> str:
    out = printed[name]
    assert f"##### {name} FAILED" not in out, f"the {name} program failed:\n{out}"
    return out


def reprs(pattern: str, text: str) -> list:
    """The repr()s captured by ``pattern``'s groups, evaluated back."""
    found = re.findall(pattern, text, re.M)
    return [tuple(ast.literal_eval(g) for g in m) if isinstance(m, tuple) else ast.literal_eval(m) for m in found]


REPR = r"('(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\")"


IMPORTS = {"generate": ["from tidyrun import LLM, EngineArgs", "from tidyrun.utils import FlexibleArgumentParser"],
           "metrics": ["from tidyrun import LLM, SamplingParams",
                       "from tidyrun.v1.metrics.reader import Counter, Gauge, Histogram, Vector"]}


def test_programs_differ_from_vllms_only_in_the_import():
    for name, source in PROGRAMS.items():
        lines = [line.strip() for line in source.splitlines() if "tidyrun" in line]
        assert lines == IMPORTS.get(name, ["from tidyrun import LLM, SamplingParams"]), name
        compile(textwrap.dedent(source), name, "exec")


def test_basic_example(printed):
    out = output_of(printed, "basic")
    pairs = reprs(rf"^Prompt: {REPR}\nOutput: {REPR}$", out)
    assert [p for p, _ in pairs] == ["My favourite season of the year is", "A good breakfast should include",
                                     "The tallest mountain in the world is"], out
    assert all(text.strip() for _, text in pairs), out


def test_generate_example_builds_the_engine_from_cli_keywords(printed):
    out = output_of(printed, "generate")
    found = reprs(rf"^Prompt: {REPR}\nOutput: {REPR}$", out)
    tokens = [int(n) for n in re.findall(r"^Tokens: (\d+)$", out, re.M)]
    assert [p for p, _ in found] == ["Three things to pack for a hike:", "The best way to learn a language is"], out
    assert all(text.strip() for _, text in found), out
    assert len(tokens) == 2 and all(1 <= n <= 8 for n in tokens), out  # --max-tokens 8


def test_chat_example(printed):
    out = output_of(printed, "chat")
    texts = reprs(rf"^Generated text: {REPR}$", out)
    assert len(texts) == 3, out  # one conversation, then a list of two
    assert all(text.strip() for text in texts), out
    single, first, second = rendered = reprs(rf"^Rendered: {REPR}$", out)
    # output.prompt: None where chat hands generate only token ids (vLLM's TokensPrompt), else the rendered text.
    prompts = re.findall(rf"^Prompt: (None|{REPR})$", out, re.M)
    assert [None if p == "None" else ast.literal_eval(p) for p, _ in prompts] in ([None] * 3, rendered), out
    assert single == first  # the same conversation renders the same prompt alone and in a list
    # The prompt is the conversation as the model's (ChatML) template renders it, ready for the reply.
    assert "<|im_start|>system\nYou are a concise assistant for a gardening shop.<|im_end|>" in single, single
    assert "Which vegetable is easiest to grow on a balcony?" in single
    assert single.endswith("<|im_start|>assistant\n"), single
    assert "Name one herb that grows in shade." in second and second.endswith("<|im_start|>assistant\n"), second


def test_reproducibility_example(printed):
    out = output_of(printed, "reproducibility")
    runs = {1: [], 2: []}
    for run, prompt, text in re.findall(rf"^run (\d): {REPR} -> {REPR}$", out, re.M):
        runs[int(run)].append((ast.literal_eval(prompt), ast.literal_eval(text)))
    assert len(runs[1]) == 2 and all(text.strip() for _, text in runs[1]), out
    assert runs[1] == runs[2], out  # LLM(seed=42) twice: the same samples
    [alone] = reprs(rf"^seeded alone: {REPR}$", out)
    [batched] = reprs(rf"^seeded in a batch: {REPR}$", out)
    assert alone.strip() and alone == batched, out


def test_prefix_caching_example(printed):
    out = output_of(printed, "prefix_caching")
    regular = reprs(rf"^without cache: {REPR} -> {REPR}$", out)
    cached = re.findall(rf"^with cache: {REPR} -> {REPR} \(cached prompt tokens: (\d+)\)$", out, re.M)
    assert len(regular) == len(cached) == 3, out
    assert all(text.strip() for _, text in regular), out
    assert [t for _, t in regular] == [ast.literal_eval(t) for _, t, _ in cached], out  # greedy: the same answers
    assert "Same answers: True" in out
    # Every prompt was admitted after the warm-up had cached the shared prefix (whole 16-token blocks of it).
    assert all(int(n) >= 48 for *_, n in cached), out


def test_metrics_example(printed):
    out = output_of(printed, "metrics")
    values = dict(re.findall(r"^(vllm:\w+) \((?:gauge|counter)\) = ([\d.]+)$", out, re.M))
    assert float(values["vllm:num_requests_running"]) == float(values["vllm:num_requests_waiting"]) == 0, out
    assert int(values["vllm:prefix_cache_queries"]) > 0, out  # the three prompts' tokens were looked up


def test_profiling_example(printed):
    out = output_of(printed, "profiling")
    assert len(reprs(rf"^Prompt: {REPR}, Generated text: {REPR}$", out)) == 2, out
    [traces] = reprs(r"^Traces: (\[.*\])$", out)
    assert len(traces) == 1 and traces[0].startswith("tidyrun.") and traces[0].endswith(".pt.trace.json.gz"), out
