"""vLLM's offline API as TRL (GRPO colocate) and verl call it: constructor keywords, model ids from the local
Hugging Face cache, and the methods they use (get_tokenizer, reset_prefix_cache, get_default_sampling_params,
chat, collective_rpc, load_weights, llm_engine). Tiny random checkpoints on the CPU; few engine builds."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from conftest import write_tiny_checkpoint
from tidyrun import LLM, InvalidRequestError, ModelLoadError, SamplingParams
from tidyrun.config import EngineConfig
from tidyrun.loader import open_model_source
from tidyrun.loader.dummy import checkpoint_shapes

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42], [9, 8, 7]]
SNAPSHOT = "0123456789abcdef0123456789abcdef01234567"
GENERATION_CONFIG = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 5,
                     "do_sample": True, "bos_token_id": 1, "eos_token_id": 2}
TEMPLATE = ("{% if tools %}<<tools: {{ tools | map(attribute='name') | join(',') }}>>{% endif %}"
            "{% for m in messages %}<<{{ m['role'] }}: {{ m['content'] }}>>{% endfor %}"
            "{% if add_generation_prompt %}<<assistant: {{ greeting | default('') }}{% endif %}")
# Every keyword TRL's colocate mode and verl's rollout pass, at a value that means what tidyrun does anyway.
NEUTRAL = dict(trust_remote_code=True, enable_sleep_mode=True, quantization=None, model_impl="vllm",
               distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs", max_logprobs=5,
               kv_cache_memory_bytes=8 << 20, revision=None, seed=None, enable_chunked_prefill=True,
               disable_log_stats=False, load_format="safetensors", skip_tokenizer_init=False, tokenizer_mode="auto",
               tensor_parallel_size=1, gpu_memory_utilization=0.5, max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=64, enable_prefix_caching=None, enforce_eager=True, dtype="auto", swap_space=0,
               cpu_offload_gb=0, hf_overrides={}, tokenizer_revision=None, disable_custom_all_reduce=True,
               compilation_config={"cudagraph_capture_sizes": [1, 2]}, kv_cache_dtype="auto",
               limit_mm_per_prompt=None, disable_mm_preprocessor_cache=True, speculative_config=None,
               tokenizer="org/tiny", enable_lora=False, max_lora_rank=16, max_loras=1, task="generate",
               runner="auto", worker_cls="auto", worker_extension_cls="", generation_config="auto",
               # the rest of what vLLM's examples pass from EngineArgs' command line, at their defaults
               pipeline_parallel_size=1, data_parallel_size=1, enable_expert_parallel=False, max_seq_len_to_capture=8192,
               disable_cascade_attn=False, disable_async_output_proc=True, use_v2_block_manager=True,
               use_tqdm_on_load=False, hf_token=None, served_model_name=None, mm_processor_kwargs=None,
               allowed_local_media_path="", enable_prompt_embeds=False, logits_processors=None,
               guided_decoding_backend="xgrammar", structured_outputs_config={"backend": "auto"},
               scheduling_policy="fcfs", preemption_mode=None, disable_sliding_window=False,
               override_generation_config=None, kv_transfer_config=None, num_gpu_blocks_override=None)


def fake_hub_cache(root, repo_id: str, checkpoint: str) -> str:
    """A Hugging Face cache under ``root`` (as HF_HOME) holding ``checkpoint`` as ``repo_id``'s main revision."""
    repo = os.path.join(root, "hub", "models--" + repo_id.replace("/", "--"))
    snapshot = os.path.join(repo, "snapshots", SNAPSHOT)
    shutil.copytree(checkpoint, snapshot)
    os.makedirs(os.path.join(repo, "refs"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write(SNAPSHOT)
    return snapshot


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory, tiny_llama_dir) -> str:
    """HF_HOME holding the tiny checkpoint as "org/tiny", with sampling defaults in its generation_config.json."""
    root = str(tmp_path_factory.mktemp("hf_home"))
    snapshot = fake_hub_cache(root, "org/tiny", tiny_llama_dir)
    with open(os.path.join(snapshot, "generation_config.json"), "w") as f:
        json.dump(GENERATION_CONFIG, f)
    return root


@pytest.fixture(scope="module")
def neutral(hf_home):
    """One engine from the id "org/tiny" with every vLLM keyword at a neutral value (the path TRL takes)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("HF_HOME", hf_home)
    mp.delenv("HF_HUB_CACHE", raising=False)
    llm = LLM("org/tiny", device="cpu", **NEUTRAL)
    yield llm
    llm.shutdown()
    mp.undo()


@pytest.fixture(scope="module")
def reference(neutral) -> list[list[int]]:
    return greedy(neutral)


@pytest.fixture(scope="module")
def dummy(tmp_path_factory, tiny_llama_dir, hf_tokenizer_dir):
    """load_format="dummy" (verl's) from a folder with no weight file at all, and a tokenizer named apart."""
    folder = str(tmp_path_factory.mktemp("no_weights"))
    for name in os.listdir(tiny_llama_dir):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(tiny_llama_dir, name), folder)
    llm = LLM(folder, device="cpu", load_format="dummy", max_model_len=128, kv_cache_memory=8 << 20,
              tokenizer=hf_tokenizer_dir)
    yield llm
    llm.shutdown()


# -- constructor keywords ----------------------------------------------------------------


def test_every_keyword_at_its_neutral_value_builds_and_takes_effect(neutral, hf_home):
    cfg = neutral.config
    assert neutral.source.path == os.path.join(hf_home, "hub", "models--org--tiny", "snapshots", SNAPSHOT)
    assert (cfg.dtype, cfg.seed, cfg.enable_prefix_caching, cfg.cuda_graph_sizes) == (None, 0, True, (1, 2))
    assert (cfg.cache.memory_bytes, cfg.logprobs_mode, cfg.max_logprobs, cfg.load_format) == (
        8 << 20, "processed_logprobs", 5, "safetensors")
    assert neutral.dtype == torch.float32 and neutral.max_model_len == 128
    with pytest.raises(InvalidRequestError, match=r"max_logprobs \(5\)"):
        neutral.generate(PROMPTS, SamplingParams(max_tokens=1, logprobs=6), use_tqdm=False)


REFUSED = [
    ("quantization", "awq", "runs unquantized weights"),
    ("model_impl", "transformers", "'auto' or 'vllm'"),
    ("distributed_executor_backend", "ray", r"\[None, 'mp', 'uni', 'external_launcher'\]"),
    ("load_format", "pt", "not PyTorch .bin/.pt"),
    ("load_format", "bitsandbytes", "load_format must be one of"),
    ("skip_tokenizer_init", True, "needs the tokenizer"),
    ("enable_chunked_prefill", "yes", "None, True or False"),
    ("pipeline_parallel_size", 2, "tensor parallelism only"),
    ("data_parallel_size", 2, "one engine"),
    ("guided_decoding_backend", "outlines", "llguidance"),
    ("structured_outputs_config", {"backend": "outlines"}, "llguidance"),
    ("logits_processors", [lambda ids, logits: logits], "no custom logits processors"),
    ("disable_sliding_window", True, "changes the model"),
    ("scheduling_policy", "priority", "first come, first served"),
    ("cpu_offload_gb", 4, "keeps the weights on the device"),
    ("tokenizer_mode", "mistral", "'auto' or 'hf'"),
    ("hf_overrides", {"num_hidden_layers": 1}, "config.json as it is"),
    ("kv_cache_dtype", "fp8", "model's dtype"),
    ("limit_mm_per_prompt", {"image": 1}, "text-only"),
    ("swap_space", -1, "never swaps"),
    ("trust_remote_code", "yes", "True or False"),
    ("compilation_config", {"level": 3}, "does not use torch.compile"),
    ("logprobs_mode", "logits", "logprobs_mode must be one of"),
    ("max_logprobs", -2, "max_logprobs must be"),
    ("enable_lora", True, "no LoRA adapters"),
    ("max_lora_rank", 0, "an int >= 1"),
    ("task", "classify", "no classification"),
    ("runner", "draft", "no classification"),
    ("worker_extension_cls", "trl.scripts.vllm_serve.WeightSyncWorkerExtension", "cannot be imported"),
    ("worker_extension_cls", "NoDots", "'package.module.Class' path"),
    ("worker_extension_cls", "os.path.join", "is not a class"),
    ("generation_config", "/some/folder", "'auto'.*'vllm'"),
]


@pytest.mark.parametrize("name, value, match", REFUSED, ids=[f"{n}={v!r}" for n, v, _ in REFUSED])
def test_a_value_tidyrun_cannot_honour_is_refused_before_the_model_is_opened(name, value, match, tmp_path):
    missing = str(tmp_path / "no_such_model")  # opening it would raise ModelLoadError instead
    with pytest.raises(InvalidRequestError, match=match) as info:
        LLM(missing, **{name: value})
    assert name in str(info.value)


def test_external_launcher_needs_a_launcher_and_aliases_must_agree(tmp_path, monkeypatch):
    missing = str(tmp_path / "no_such_model")
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(InvalidRequestError, match="external_launcher.*torchrun.*RANK, WORLD_SIZE, MASTER_ADDR, "
                                                  "MASTER_PORT not set here"):
        LLM(missing, distributed_executor_backend="external_launcher", tensor_parallel_size=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")  # what torchrun --master-port 0 passes on
    with pytest.raises(InvalidRequestError, match="MASTER_PORT=0 is not a port"):
        LLM(missing, distributed_executor_backend="external_launcher", tensor_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="process_group .* needs tensor_parallel_size > 1 and "
                                                  "distributed_executor_backend='external_launcher'"):
        LLM(missing, process_group=object())
    with pytest.raises(InvalidRequestError, match=r"distributed_executor_backend='uni'.*\[None, 'mp', "
                                                  r"'external_launcher'\]"):
        LLM(missing, distributed_executor_backend="uni", tensor_parallel_size=2)
    with pytest.raises(InvalidRequestError, match="kv_cache_memory=1 and kv_cache_memory_bytes=2 are one option"):
        LLM(missing, kv_cache_memory=1, kv_cache_memory_bytes=2)
    with pytest.raises(InvalidRequestError, match="cuda_graph_sizes=.* are one option"):
        LLM(missing, cuda_graph_sizes=[1], compilation_config={"cudagraph_capture_sizes": [2]})
    with pytest.raises(InvalidRequestError, match="quantization='gguf' needs a GGUF model"):
        LLM(missing, quantization="gguf", load_format="safetensors")


def test_gguf_quantization_needs_a_gguf_model(tiny_llama_dir):
    with pytest.raises(InvalidRequestError, match=r"'gguf' asks for a GGUF model, but .* is not a \.gguf file"):
        LLM(tiny_llama_dir, quantization="gguf")
    with pytest.raises(InvalidRequestError, match="load_format='safetensors' asks for a Hugging Face folder"):
        LLM(load_format="safetensors")  # the default model is a GGUF file


def test_an_unknown_keyword_is_a_type_error(tmp_path):
    with pytest.raises(TypeError, match="enable_lora_bias"):
        LLM(str(tmp_path), enable_lora_bias=True)


def test_a_config_still_refuses_other_options_and_checks_no_effect_ones(tiny_llama_dir):
    cfg = EngineConfig(model=tiny_llama_dir, device="cpu")
    with pytest.raises(InvalidRequestError, match=r"also got load_format='dummy', revision='v2';"):
        LLM(config=cfg, load_format="dummy", revision="v2")
    with pytest.raises(InvalidRequestError, match="model_impl='transformers'"):
        LLM(config=cfg, model_impl="transformers")
    with pytest.raises(InvalidRequestError, match="external_launcher"):
        LLM(config=EngineConfig(model=tiny_llama_dir, tensor_parallel_size=2),
            distributed_executor_backend="external_launcher")


# -- model ids from the local Hugging Face cache -------------------------------------------


def test_model_ids_resolve_from_the_cache_offline(hf_home, tmp_path, monkeypatch, tiny_llama_dir):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", hf_home)
    snapshot = os.path.join(hf_home, "hub", "models--org--tiny", "snapshots", SNAPSHOT)
    assert open_model_source("org/tiny").path == snapshot
    assert open_model_source("org/tiny", revision=SNAPSHOT).path == snapshot
    monkeypatch.setenv("HF_HUB_CACHE", os.path.join(hf_home, "hub"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE wins
    assert open_model_source("org/tiny").path == snapshot
    monkeypatch.delenv("HF_HUB_CACHE")
    assert open_model_source("org/tiny", download_dir=os.path.join(hf_home, "hub")).path == snapshot
    cache = str(tmp_path / "elsewhere" / "hub")
    with pytest.raises(ModelLoadError, match=rf"'org/tiny' is not a local path, and not in the local Hugging Face "
                                             rf"cache at '{cache}'; tidyrun does not download"):
        open_model_source("org/tiny")
    monkeypatch.setenv("HF_HOME", hf_home)
    with pytest.raises(ModelLoadError, match="at revision 'v9'; tidyrun does not download"):
        open_model_source("org/tiny", revision="v9")
    with pytest.raises(ModelLoadError, match="'org/other' is not a local path"):
        LLM("org/other")
    with pytest.raises(InvalidRequestError, match="revision='main' applies to Hugging Face ids, but model .* is a "
                                                  "local path"):
        LLM(tiny_llama_dir, revision="main")


# -- methods ------------------------------------------------------------------------------


def test_get_tokenizer_is_the_transformers_tokenizer(neutral):
    tok = neutral.get_tokenizer()
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok.decode(ids) == "Hello world" and tok.eos_token_id == 2
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False).startswith("<|im_start|>")
    out = neutral.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids


def test_default_sampling_params_come_from_generation_config(neutral, dummy):
    params = neutral.get_default_sampling_params()
    assert (params.temperature, params.top_p, params.top_k, params.repetition_penalty, params.max_tokens) == (
        0.6, 0.9, 20, 1.1, 5)
    params.temperature = 0.0  # a new object every call: changing it changes nothing else
    assert neutral.get_default_sampling_params().temperature == 0.6
    [out] = neutral.generate(PROMPTS[0], use_tqdm=False)  # no SamplingParams: the model's defaults
    assert len(out.outputs[0].token_ids) == 5
    assert dummy.get_default_sampling_params() == SamplingParams()  # its generation_config.json sets no sampling


def test_an_invalid_generation_config_is_a_load_error(tmp_path):
    from tidyrun.loader import generation_defaults

    assert generation_defaults(str(tmp_path)) == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1.0, "top_k": None}))
    with pytest.raises(ModelLoadError, match="generation_config.json' sets an invalid sampling default.*temperature"):
        generation_defaults(str(tmp_path))


def test_chat_passes_vllm_arguments_to_the_template(neutral):
    tok = neutral.get_tokenizer()
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "It is Par"}]
    cases = [
        (dict(chat_template=TEMPLATE, add_generation_prompt=True, chat_template_kwargs={"greeting": "Well,"}),
         "<<user: Capital of France?>><<assistant: It is Par>><<assistant: Well,"),
        (dict(chat_template=TEMPLATE, add_generation_prompt=False, continue_final_message=True),
         "<<user: Capital of France?>><<assistant: It is Par"),
        (dict(chat_template=TEMPLATE, add_generation_prompt=False, tools=[{"name": "search"}, {"name": "calc"}]),
         "<<tools: search,calc>><<user: Capital of France?>><<assistant: It is Par>>"),
    ]
    for kwargs, text in cases:
        [out] = neutral.chat(messages, GREEDY, use_tqdm=False, **kwargs)
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False)
        assert out.prompt == text  # the rendered conversation, as vLLM's chat() reports it
    [out] = neutral.chat(messages[:1], GREEDY, False)  # the model's own (ChatML) template
    chatml = tok.apply_chat_template(messages[:1], add_generation_prompt=True, tokenize=False)
    assert chatml.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == tok.encode(chatml, add_special_tokens=False) and out.prompt == chatml
    with pytest.raises(InvalidRequestError, match="continue_final_message=True needs add_generation_prompt=False"):
        neutral.chat(messages, GREEDY, use_tqdm=False, continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="chat template failed to render.*boom"):
        neutral.chat(messages, GREEDY, use_tqdm=False, chat_template="{{ raise_exception('boom') }}")
    with pytest.raises(InvalidRequestError, match=r"may not set \['tokenize'\]"):
        neutral.chat(messages, GREEDY, use_tqdm=False, chat_template_kwargs={"tokenize": True})
    with pytest.raises(InvalidRequestError, match="chat_template_content_format must be 'auto', 'string' or"):
        neutral.chat(messages, GREEDY, use_tqdm=False, chat_template_content_format="blocks")


PARTS_TEMPLATE = ("{% for m in messages %}<<{{ m['role'] }}:{% if m['content'] is string %}s={{ m['content'] }}"
                  "{% else %}{% for p in m['content'] %}[{{ p['text'] }}]{% endfor %}{% endif %}>>{% endfor %}")


def test_chat_takes_openai_content_parts_as_vllm_does(neutral):
    """Contents as OpenAI text parts or None (tool-call turns): joined by newlines for a string template
    ("auto" / "string"), handed over as parts with "openai"; other parts and mm_processor_kwargs refused."""
    tok = neutral.get_tokenizer()
    parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]},
             {"role": "assistant", "content": None}]
    cases = [("auto", "<<user:s=Hi\nthere>><<assistant:s=>>"), ("string", "<<user:s=Hi\nthere>><<assistant:s=>>"),
             ("openai", "<<user:[Hi][there]>><<assistant:>>")]
    for content_format, text in cases:
        [out] = neutral.chat(parts, GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE, add_generation_prompt=False,
                             chat_template_content_format=content_format)
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False), content_format
    [out] = neutral.chat([{"role": "user", "content": "plain"}], GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE,
                         add_generation_prompt=False, chat_template_content_format="openai")
    assert out.prompt_token_ids == tok.encode("<<user:[plain]>>", add_special_tokens=False)
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]
    with pytest.raises(InvalidRequestError, match="content part must be .*text-only.*image_url"):
        neutral.chat(image, GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="mm_processor_kwargs=.*text-only"):
        neutral.chat(parts[:1], GREEDY, use_tqdm=False, mm_processor_kwargs={"num_crops": 4})
    assert not neutral.has_unfinished_requests()


def test_prompt_types_and_numpy_token_ids_as_vllm_takes_them(neutral, reference):
    """``TokensPrompt`` / ``TextPrompt`` (vllm.inputs), token ids as NumPy or torch integers (verl passes
    ``list(ndarray)``) or a 1-D array: the same requests as plain ints. A bool, a float array or a
    multi-modal prompt is refused by name; vLLM's empty multi-modal keys are accepted."""
    import numpy as np

    from tidyrun import TextPrompt, TokensPrompt
    from tidyrun.inputs import TextPrompt as TextPrompt2, TokensPrompt as TokensPrompt2

    assert (TextPrompt, TokensPrompt) == (TextPrompt2, TokensPrompt2)
    a, b = (np.array(p, dtype=np.int64) for p in PROMPTS)
    prompts = [TokensPrompt(prompt_token_ids=list(a)), {"prompt_token_ids": torch.tensor(b), "multi_modal_data": None}]
    assert [list(o.outputs[0].token_ids) for o in neutral.generate(prompts, GREEDY, use_tqdm=False)] == reference
    assert [list(o.outputs[0].token_ids) for o in neutral.generate([list(a), b.tolist()], GREEDY, use_tqdm=False)] \
        == reference
    assert [list(o.outputs[0].token_ids) for o in neutral.generate([a, torch.tensor(b)], GREEDY, use_tqdm=False)] \
        == reference  # a list of arrays: one prompt each
    assert list(neutral.generate(a, GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == reference[0]
    [one] = neutral.generate(list(a), GREEDY, use_tqdm=False)  # one prompt of NumPy ints, not a list of prompts
    assert one.prompt_token_ids == PROMPTS[0] and all(type(t) is int for t in one.prompt_token_ids)
    text = neutral.generate(TextPrompt(prompt="Hello"), GREEDY, use_tqdm=False)[0]
    assert text.prompt == "Hello"
    bad = [({"prompt_token_ids": [5, np.bool_(True)]}, "token ids must be ints"),
           ({"prompt_token_ids": [torch.tensor(True), torch.tensor(5)]}, "token ids must be ints"),
           ({"prompt_token_ids": np.array([1.5, 2.0])}, "token ids must be ints"),
           ({"prompt_token_ids": np.zeros((2, 2), dtype=np.int64)}, "must be a list of int, got ndarray"),
           ({"prompt": "Hi", "multi_modal_data": {"image": "x.png"}}, r"text-only models\); got \['multi_modal_data'\]")]
    for prompt, match in bad:
        with pytest.raises(InvalidRequestError, match=match):
            neutral.generate(prompt, GREEDY, use_tqdm=False)
    assert not neutral.has_unfinished_requests()


def test_outputs_and_generate_keywords_as_in_vllm(neutral):
    """``CompletionOutput.finished()`` is a method (``RequestOutput.finished`` is not); ``priority`` None or all
    0 (first come, first served), anything else refused."""
    [out] = neutral.generate(PROMPTS[0], GREEDY, use_tqdm=False, priority=[0])
    assert out.finished is True and out.outputs[0].finished() is True
    assert (out.metrics, out.lora_request, out.encoder_prompt, out.outputs[0].lora_request) == (None, None, None, None)
    with pytest.raises(InvalidRequestError, match=r"priority=\[0, 3\] is not supported"):
        neutral.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0, 3])
    with pytest.raises(InvalidRequestError, match="priority must be None or a list of ints"):
        neutral.generate(PROMPTS, GREEDY, use_tqdm=False, priority=1)
    with pytest.raises(InvalidRequestError, match="lengths of prompts and priority must be the same"):  # vLLM's
        neutral.generate(PROMPTS, GREEDY, use_tqdm=False, priority=[0])
    assert not neutral.has_unfinished_requests()


def test_llm_engine_answers_what_callers_read_from_vllms_engine(neutral):
    """lm-evaluation-harness, OpenRLHF and TRL read these off ``llm.llm_engine``; nothing else is handed out."""
    engine = neutral.llm_engine
    mc = engine.model_config
    assert (mc.max_model_len, mc.dtype, mc.get_vocab_size()) == (128, torch.float32, neutral.runner.model_config.vocab_size)
    assert mc.get_diff_sampling_param() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1,
                                            "max_tokens": 5}
    assert engine.cache_config.block_size == 16 and engine.vllm_config.model_config.max_model_len == 128
    assert engine.vllm_config.parallel_config.tensor_parallel_size == 1
    assert engine.vllm_config.scheduler_config.max_num_seqs == 4
    assert engine.reset_prefix_cache() is True and engine.get_tokenizer() is neutral.get_tokenizer()
    assert engine.is_sleeping() is False
    with pytest.raises(AttributeError, match="has no 'named_parameters'.*not handed out"):
        engine.model_executor.driver_worker.model_runner.model.named_parameters()
    hf = mc.hf_config  # what scripts read for sizes, under Hugging Face's names
    source = neutral.runner.model_config
    assert (hf.vocab_size, hf.num_hidden_layers, hf.hidden_size, hf.max_position_embeddings) == (
        source.vocab_size, source.num_layers, source.hidden_size, source.max_position_embeddings)
    assert hf.architectures == mc.architectures == [source.architecture]
    assert engine.get_model_config().max_model_len == 128
    # vLLM users' "free the GPU" idiom before `del llm`: nothing to delete here, and no error
    del neutral.llm_engine.model_executor.driver_worker
    del neutral.llm_engine.model_executor
    assert neutral.llm_engine.model_executor.driver_worker.model_runner.model.reset_prefix_cache() is True


def test_generation_config_vllm_leaves_the_models_defaults_out(hf_home, monkeypatch):
    monkeypatch.setenv("HF_HOME", hf_home)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    llm = LLM("org/tiny", device="cpu", max_model_len=64, kv_cache_memory=1 << 20, generation_config="vllm",
              enforce_eager=None)
    try:
        assert llm.get_default_sampling_params() == SamplingParams()
        assert llm.llm_engine.model_config.get_diff_sampling_param() == {}
        assert llm.config.enforce_eager is False  # None: vLLM's "pick for me"
    finally:
        llm.shutdown()


def test_lora_requests_are_refused(neutral):
    for call in (lambda: neutral.generate(PROMPTS, GREEDY, False, lora_request=("adapter", 1, "/path")),
                 lambda: neutral.chat([{"role": "user", "content": "Hi"}], GREEDY, False, lora_request="adapter")):
        with pytest.raises(InvalidRequestError, match="lora_request=.* is not supported: tidyrun has no LoRA"):
            call()
    assert not neutral.has_unfinished_requests()


def test_reset_prefix_cache(neutral):
    prompt = list(range(100, 150))  # 3 full blocks of 16
    cached = lambda: neutral.stats()["prefix_cached_tokens"]  # noqa: E731
    neutral.generate(prompt, GREEDY, use_tqdm=False)
    before = cached()
    neutral.generate(prompt, GREEDY, use_tqdm=False)
    assert cached() == before + 48
    assert neutral.reset_prefix_cache() is True
    neutral.generate(prompt, GREEDY, use_tqdm=False)
    assert cached() == before + 48  # nothing was left to reuse
    request_id = neutral.add_request(prompt, GREEDY)
    assert neutral.reset_prefix_cache() is False  # as vLLM: not while requests hold blocks
    neutral.abort_request(request_id)
    neutral.step()


def test_reset_prefix_cache_of_running_requests(neutral):
    """vLLM's reset_prefix_cache(reset_running_requests=True): requests in flight are preempted (they
    recompute their tokens so far) and the cache is reset; their outputs are what they would have been."""
    prompts = [list(range(200, 250)), list(range(300, 340))]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in neutral.generate(prompts, params, use_tqdm=False)]
    ids = [neutral.add_request(p, params) for p in prompts]
    for _ in range(3):
        neutral.step()
    preempted, cached = neutral.stats()["preemptions"], neutral.stats()["prefix_cached_tokens"]
    assert neutral.reset_prefix_cache(reset_running_requests=True, reset_connector=True) is True
    assert neutral.stats()["preemptions"] == preempted + 2
    outputs = {}
    while neutral.has_unfinished_requests():
        outputs.update({o.request_id: o for o in neutral.step() if o.finished})
    assert [outputs[i].outputs[0].token_ids for i in ids] == alone
    assert neutral.stats()["prefix_cached_tokens"] == cached  # the recompute found nothing left to reuse
    assert neutral.llm_engine.reset_prefix_cache(reset_running_requests=True) is True  # idle: a plain reset


def test_weight_pushes_through_llm_engine_and_load_weights(neutral, reference):
    weights = dict(neutral.source.iter_weights())
    noise = {n: t + torch.randn_like(t) for n, t in weights.items() if n.endswith("mlp.down_proj.weight")}
    # TRL: one tensor at a time through vLLM's path to the model.
    for name, tensor in noise.items():
        neutral.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, tensor)])
    perturbed = greedy(neutral)
    assert perturbed != reference
    # verl: a generator through ...driver_worker.worker.model_runner.model; vLLM returns the names loaded.
    model = neutral.llm_engine.model_executor.driver_worker.worker.model_runner.model
    assert model.load_weights((n, t) for n, t in weights.items() if n in noise) == set(noise)
    assert greedy(neutral) == reference
    assert neutral.load_weights(noise.items()) == len(noise)
    assert greedy(neutral) == perturbed
    neutral.load_weights(weights.items())
    request_id = neutral.add_request(PROMPTS[0], GREEDY)
    with pytest.raises(InvalidRequestError, match="in flight"):
        neutral.load_weights(weights.items())
    neutral.abort_request(request_id)
    neutral.step()
    with pytest.raises(AttributeError):
        neutral.llm_engine.model = None  # read-only: there is nothing to replace


def runner_facts(worker, extra):
    """A collective_rpc function: what it received (vLLM's worker attributes, the runner's own passed through)."""
    assert worker.shard.rank == worker.rank
    return type(worker.model_runner).__name__, worker.rank, extra


def echo_rank(self):
    """vLLM's own collective_rpc test function."""
    return self.rank


class WeightSyncExtension:
    """A worker_extension_cls as vLLM's RLHF examples write one: state kept on the worker between calls, weights
    pushed through ``self.model_runner.model.load_weights``."""

    def init_sync(self, scale):
        self.scale = scale
        return self.rank

    def update_weight(self, name, tensor):
        return self.model_runner.model.load_weights(weights=[(name, tensor * self.scale)])

    def report_device(self):
        return str(self.device), self.local_rank


def model_facts(model) -> tuple[str, int]:
    """An apply_model function (module level: it pickles to tensor-parallel workers)."""
    return type(model).__name__, sum(p.numel() for p in model.parameters())


def test_collective_rpc(dummy, neutral, reference):
    real = list(neutral.source.iter_weights())
    assert greedy(dummy) != reference  # random weights
    assert dummy.collective_rpc("load_weights", kwargs={"weights": iter(real)}) == [len(real)]
    assert greedy(dummy) == reference  # the same as an engine that read the checkpoint
    assert dummy.collective_rpc(runner_facts, args=("x",)) == [("ModelRunner", 0, "x")]
    assert dummy.collective_rpc(echo_rank) == [0]
    with pytest.raises(InvalidRequestError, match="unsupported method 'execute_model'.*'reload_weights'.*"
                                                  "'load_weights'.*or pass a function"):
        dummy.collective_rpc("execute_model")
    with pytest.raises(InvalidRequestError, match="unsupported method 'init_sync'"):  # no extension here
        dummy.collective_rpc("init_sync", args=(1.0,))
    with pytest.raises(InvalidRequestError, match=r"timeout=5\.0\) is not supported"):
        dummy.collective_rpc("load_weights", timeout=5.0, kwargs={"weights": []})


def test_a_collective_rpc_function_loads_weights_one_at_a_time_as_in_vllm(tiny_llama_dir):
    """``self.model_runner.model.load_weights([(name, tensor)])`` inside a function loads that one tensor (vLLM's
    ``model.load_weights`` takes any subset: TRL's weight-sync extension pushes one parameter per call); it
    was refused as a checkpoint missing every other weight."""
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=64, kv_cache_memory=1 << 20)
    try:
        before = greedy(llm)
        name, tensor = next(n_t for n_t in llm.source.iter_weights() if n_t[0] == "model.norm.weight")
        push = lambda worker, value: worker.model_runner.model.load_weights([(name, value)])  # noqa: E731
        assert llm.collective_rpc(push, args=(torch.zeros_like(tensor),)) == [{name}]
        assert llm.reset_prefix_cache() and greedy(llm) != before
        assert llm.collective_rpc(push, args=(tensor,)) == [{name}]
        assert llm.reset_prefix_cache() and greedy(llm) == before
        # vLLM's apply_model: the function gets the model itself, the same one collective_rpc's worker holds.
        assert llm.apply_model(lambda model: model.load_weights([(name, torch.zeros_like(tensor))])) == [{name}]
        assert llm.reset_prefix_cache() and greedy(llm) != before
        llm.apply_model(lambda model: model.load_weights([(name, tensor)]))
        assert llm.reset_prefix_cache() and greedy(llm) == before
        [(kind, count)] = llm.apply_model(model_facts)
        assert count == sum(t.numel() for _, t in llm.source.iter_weights()) and kind.endswith("ForCausalLM")
        with pytest.raises(InvalidRequestError, match="apply_model needs a function of the model, got str"):
            llm.apply_model("load_weights")
    finally:
        llm.shutdown()


def test_worker_extension_cls_methods_run_by_name_and_keep_their_state(tiny_llama_dir):
    """``LLM(worker_extension_cls=...)`` (a class, or its "module.Class" path): ``collective_rpc("name")`` runs
    that method with the rank's worker as ``self`` (``model_runner.model.load_weights``, ``rank``, ``device``),
    and what one call sets on ``self`` the next one finds, as vLLM's RLHF examples rely on."""
    from tidyrun.runner.rpc import load_extension

    assert load_extension("test_vllm_api.WeightSyncExtension") is WeightSyncExtension
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=64, kv_cache_memory=1 << 20,
              worker_extension_cls=WeightSyncExtension)
    try:
        before = greedy(llm)
        assert llm.collective_rpc("report_device") == [("cpu", 0)]
        name, tensor = next(n_t for n_t in llm.source.iter_weights() if n_t[0] == "model.norm.weight")
        assert llm.collective_rpc("init_sync", args=(0.0,)) == [0]
        assert llm.collective_rpc("update_weight", args=(name, tensor)) == [{name}]
        assert llm.reset_prefix_cache() and greedy(llm) != before
        llm.collective_rpc("init_sync", args=(1.0,))
        assert llm.collective_rpc("update_weight", kwargs={"name": name, "tensor": tensor}) == [{name}]
        assert llm.reset_prefix_cache() and greedy(llm) == before
        with pytest.raises(InvalidRequestError, match="unsupported method 'execute_model'.*WeightSyncExtension: "
                                                      "init_sync, report_device, update_weight"):
            llm.collective_rpc("execute_model")
    finally:
        llm.shutdown()


def test_engine_args_are_llms_keywords_as_a_dataclass_and_as_options():
    """vLLM's ``EngineArgs`` (``LLM(**asdict(EngineArgs(...)))``, ``add_cli_args`` / ``from_cli_args``) and
    ``FlexibleArgumentParser`` (``--max_model_len`` = ``--max-model-len``): one field per LLM keyword, LLM's
    defaults; the generate example in test_vllm_examples builds an engine from them."""
    import dataclasses
    import inspect

    from tidyrun import EngineArgs
    from tidyrun.utils import FlexibleArgumentParser

    keywords = {n: p.default for n, p in inspect.signature(LLM.__init__).parameters.items()
                if n not in ("self", "config", "process_group")}
    assert {f.name: f.default for f in dataclasses.fields(EngineArgs)} == keywords
    assert dataclasses.asdict(EngineArgs(model="m", max_model_len=64)) == dict(keywords, model="m", max_model_len=64)
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", "org/x", "--max_model_len", "64", "--enforce-eager", "--seed=3",
                              "--no-enable-prefix-caching", "--cuda-graph-sizes", "1", "4",
                              "--compilation-config", '{"cudagraph_capture_sizes": [1]}', "--dtype", "bfloat16"])
    engine = EngineArgs.from_cli_args(args)
    assert (engine.model, engine.max_model_len, engine.enforce_eager, engine.seed) == ("org/x", 64, True, 3)
    assert (engine.enable_prefix_caching, engine.cuda_graph_sizes, engine.dtype) == (False, [1, 4], "bfloat16")
    assert engine.compilation_config == {"cudagraph_capture_sizes": [1]} and engine.max_num_seqs == 256
    with pytest.raises(SystemExit):  # argparse's own error for a malformed option value
        parser.parse_args(["--hf-overrides", "{not json"])


def test_older_vllm_spellings_pinned_rl_code_still_uses(tiny_llama_dir):
    """``generate(prompt_token_ids=..., sampling_params=...)`` (vLLM until 0.10: OpenRLHF's and older verl's
    rollouts) and ``LLM(num_gpu_blocks_override=)`` (= ``num_kv_blocks``)."""
    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=64, num_gpu_blocks_override=40)
    try:
        assert llm.runner.num_kv_blocks == 40
        params = SamplingParams(temperature=0, max_tokens=4)
        ids = [[5, 6, 7], [8, 9]]
        expected = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": x} for x in ids], params,
                                                                  use_tqdm=False)]
        out = llm.generate(prompt_token_ids=ids, sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == expected and out[1].prompt_token_ids == ids[1]
        one = llm.generate(prompt_token_ids=ids[0], sampling_params=params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in one] == expected[:1]
        with pytest.raises(InvalidRequestError, match="both prompts and prompt_token_ids"):
            llm.generate("a", params, prompt_token_ids=ids)
        with pytest.raises(InvalidRequestError, match="needs prompts"):
            llm.generate(sampling_params=params)
        with pytest.raises(InvalidRequestError):
            llm.generate(prompt_token_ids=[[5, "x"]], sampling_params=params)
    finally:
        llm.shutdown()


def test_collective_rpc_reload_weights(dummy, neutral, reference):
    neutral.load_weights((n, torch.zeros_like(t)) for n, t in neutral.source.iter_weights()
                         if n.endswith("o_proj.weight"))
    assert greedy(neutral) != reference
    neutral.collective_rpc("reload_weights")
    assert greedy(neutral) == reference
    neutral.sleep(level=2)  # verl's and TRL's cycle: weights discarded, woken empty, filled, then the KV cache
    neutral.wake_up(["weights"])
    assert neutral.collective_rpc("reload_weights") == [len(list(neutral.source.iter_weights()))]
    neutral.wake_up(["kv_cache"])
    assert greedy(neutral) == reference
    dummy.collective_rpc("reload_weights")  # the dummy source re-reads its own (random) weights
    assert greedy(dummy) != reference


def test_dummy_weights_have_the_checkpoints_names_and_shapes(dummy, hf_tokenizer_dir, tmp_path):
    shards = dummy.runner.model.weight_shards()
    assert checkpoint_shapes(dummy.runner.model_config) == {n: s[0].shape for n, s in shards.items()}
    for name, tensor in dummy.source.iter_weights():
        assert tensor.abs().max() <= 1e-3, name
    assert not any(f.endswith(".safetensors") for f in os.listdir(dummy.source.path))
    assert dummy.get_tokenizer().name_or_path == hf_tokenizer_dir  # the tokenizer= keyword
    # Attention biases and a tied head: the names and shapes of a real Qwen2 checkpoint written by transformers.
    qwen = write_tiny_checkpoint(str(tmp_path / "qwen2"), hf_tokenizer_dir, arch="qwen2", num_hidden_layers=1,
                                 tie_word_embeddings=True)
    shapes = {n: tuple(t.shape) for n, t in open_model_source(qwen).iter_weights()}
    assert any(n.endswith("q_proj.bias") for n in shapes) and "lm_head.weight" not in shapes
    assert {n: tuple(t.shape) for n, t in open_model_source(qwen, load_format="dummy").iter_weights()} == shapes


def refuse(worker):
    """A collective_rpc function that fails on every rank alike."""
    raise ValueError(f"refused on rank {worker.rank}")


def test_collective_rpc_reaches_every_tensor_parallel_rank(tmp_path):
    from tidyrun.synthetic import write_random_checkpoint

    shape = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=96, vocab_size=512, max_position_embeddings=128, tie_word_embeddings=False,
                 rope_theta=1e4)
    folder = write_random_checkpoint(str(tmp_path / "tp"), shape, torch.float32, std=0.1)
    with LLM(folder, device="cpu", tensor_parallel_size=2, kv_cache_memory=4 << 20,
             distributed_executor_backend="mp") as llm:
        assert llm.collective_rpc(runner_facts, args=("x",)) == [("TPDriverRunner", 0, "x"), ("ModelRunner", 1, "x")]
        assert [kind for kind, _ in llm.apply_model(model_facts)] == ["LlamaForCausalLM"] * 2  # each rank's model
        before = greedy(llm)
        weights = dict(llm.source.iter_weights())
        noisy = {n: t.flip(0) for n, t in weights.items() if n.endswith("up_proj.weight")}
        assert llm.collective_rpc("load_weights", kwargs={"weights": noisy}) == [2, 2]
        assert greedy(llm) != before
        assert llm.collective_rpc("load_weights", args=(weights,)) == [len(weights)] * 2
        llm.collective_rpc("load_weights", kwargs={"weights": noisy})
        assert llm.collective_rpc("reload_weights") == [len(weights)] * 2  # every rank reads its slice again
        with pytest.raises(InvalidRequestError, match="must be picklable"):
            llm.collective_rpc(lambda runner: runner.shard.rank)
        with pytest.raises(ValueError, match="refused on rank 0"):
            llm.collective_rpc(refuse)
        assert greedy(llm) == before  # the ranks are still in step


def test_new_methods_after_shutdown(tiny_llama_dir):
    import gc

    from tidyrun import EngineShutdownError

    llm = LLM(tiny_llama_dir, device="cpu", max_model_len=64, kv_cache_memory=1 << 20)
    path = llm.llm_engine.model_executor.driver_worker.model_runner.model
    llm.shutdown()
    calls = [llm.get_tokenizer, llm.get_default_sampling_params, llm.reset_prefix_cache, lambda: llm.llm_engine,
             lambda: llm.collective_rpc(runner_facts, args=(1,)), lambda: llm.apply_model(model_facts),
             lambda: llm.load_weights([]),
             lambda: path.load_weights([])]
    for call in calls:
        with pytest.raises(EngineShutdownError, match="shut down"):
            call()
    del llm, calls, call  # the bound methods held it
    gc.collect()
    with pytest.raises(EngineShutdownError, match="is gone"):  # the path kept nothing alive
        path.load_weights([])


def test_use_tqdm_takes_a_progress_bar_factory(llm):
    """vLLM's ``use_tqdm`` may be a callable used in tqdm's place (with tqdm's keyword arguments)."""
    from tidyrun import SamplingParams

    made = []

    class Bar:
        def __init__(self, **kwargs):
            made.append(kwargs)
            self.n = 0

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, k):
            self.n += k

    out = llm.generate(["a", "b"], SamplingParams(max_tokens=2), use_tqdm=Bar)
    assert len(out) == 2 and made and made[0]["total"] == 2


def test_get_metrics_reports_prefix_cache_hits_by_vllms_names(llm):
    from tidyrun import SamplingParams

    before = {m.name: m.value for m in llm.get_metrics()}
    prefix = "You are a helpful assistant. " * 12
    llm.generate([prefix + "One.", prefix + "Two."], SamplingParams(max_tokens=1), use_tqdm=False)
    llm.generate([prefix + "Three."], SamplingParams(max_tokens=1), use_tqdm=False)
    after = {m.name: m.value for m in llm.get_metrics()}
    assert after["vllm:prefix_cache_queries"] > before["vllm:prefix_cache_queries"]
    assert after["vllm:prefix_cache_hits"] - before["vllm:prefix_cache_hits"] >= 48  # the shared prefix's blocks
    assert after["vllm:num_requests_running"] == 0 and 0 <= after["vllm:kv_cache_usage_perc"] <= 1
