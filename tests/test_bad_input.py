"""Bad input of every kind gets a tidyrun exception type and a message that names the problem."""

from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import write_tiny_checkpoint

from tidyrun import (LLM, EngineShutdownError, InvalidRequestError, ModelLoadError, OutOfResourcesError,
                     PromptTooLongError, SamplingParams, TidyrunError, UnsupportedModelError)

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)


# -- model sources -----------------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = tmp_path / "no" / "such" / "model.gguf"
    with pytest.raises(ModelLoadError, match="does not exist") as info:
        LLM(str(missing), device="cpu")
    assert str(missing) in str(info.value)


def test_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\0" * 128)
    with pytest.raises(ModelLoadError, match="is not a .gguf file"):
        LLM(str(path), device="cpu")


def test_folder_without_model(tmp_path):
    (tmp_path / "README.md").write_text("nothing to see")
    with pytest.raises(ModelLoadError, match="neither config.json nor a .gguf file"):
        LLM(str(tmp_path), device="cpu")


@pytest.mark.parametrize("content", [
    pytest.param(bytes(range(256)) * 64, id="random-bytes"),
    pytest.param(b"GGUX" + b"\3\0\0\0" + b"\0" * 1024, id="wrong-magic"),
    pytest.param(b"", id="empty"),
])
def test_corrupt_gguf(tmp_path, content):
    path = tmp_path / "x.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file") as info:
        LLM(str(path), device="cpu")
    assert not isinstance(info.value, UnsupportedModelError)


def test_corrupt_gguf_in_folder(tmp_path):
    (tmp_path / "only.gguf").write_bytes(b"not a gguf at all" * 10)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        LLM(str(tmp_path), device="cpu")


def test_truncated_gguf(tmp_path, default_model):
    size = os.path.getsize(default_model)
    path = tmp_path / "truncated.gguf"
    with open(default_model, "rb") as src:
        path.write_bytes(src.read(int(size * 0.4)))
    # The header is intact, but the tensor data it describes runs past the end of the file.
    with pytest.raises(ModelLoadError, match="truncated.gguf"):
        LLM(str(path), device="cpu", max_model_len=256)


# -- Hugging Face folders ----------------------------------------------------------------


@pytest.fixture(scope="module")
def pristine_checkpoint(tmp_path_factory, hf_tokenizer_dir) -> str:
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp("pristine")), hf_tokenizer_dir)


@pytest.fixture
def checkpoint(tmp_path, pristine_checkpoint) -> str:
    """A private copy of a valid tiny checkpoint that a test may damage."""
    out = str(tmp_path / "ckpt")
    shutil.copytree(pristine_checkpoint, out)
    return out


def _edit_config(folder: str, edit) -> None:
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    edit(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)


def test_undamaged_checkpoint_loads(checkpoint):
    """Control for the tests below: the checkpoint they damage is valid as written.

    Also the prompt-length boundary, on a model small enough to fill its context quickly: the context must
    hold the prompt plus one generated token.
    """
    with LLM(checkpoint, device="cpu", max_model_len=64) as engine:
        out = engine.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 4
        out = engine.generate([[5] * 63], GREEDY, use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 1 and out.finish_reason == "length"
        with pytest.raises(PromptTooLongError, match="64 tokens"):
            engine.generate([[5] * 64], GREEDY, use_tqdm=False)
        assert not engine.has_unfinished_requests()


def test_config_invalid_json(checkpoint):
    with open(os.path.join(checkpoint, "config.json"), "w") as f:
        f.write('{"model_type": "llama", "hidden_size": 64,')
    with pytest.raises(ModelLoadError, match="cannot read") as info:
        LLM(checkpoint, device="cpu")
    assert "config.json" in str(info.value)


def test_config_not_an_object(checkpoint):
    with open(os.path.join(checkpoint, "config.json"), "w") as f:
        json.dump(["llama"], f)
    with pytest.raises(ModelLoadError, match="must hold a JSON object"):
        LLM(checkpoint, device="cpu")


def test_unsupported_model_type(checkpoint):
    _edit_config(checkpoint, lambda c: c.update(model_type="gpt2"))
    with pytest.raises(UnsupportedModelError, match="model_type 'gpt2'"):
        LLM(checkpoint, device="cpu")


@pytest.mark.parametrize("field", ["hidden_size", "vocab_size", "num_attention_heads", "intermediate_size",
                                   "num_hidden_layers"])
def test_config_missing_required_field(checkpoint, field):
    _edit_config(checkpoint, lambda c: c.pop(field))
    with pytest.raises(ModelLoadError, match=f"lacks required field '{field}'"):
        LLM(checkpoint, device="cpu")


def test_config_malformed_field(checkpoint):
    _edit_config(checkpoint, lambda c: c.update(hidden_size="wide"))
    with pytest.raises(ModelLoadError, match="malformed field"):
        LLM(checkpoint, device="cpu")


def test_config_without_weights(checkpoint):
    os.remove(os.path.join(checkpoint, "model.safetensors"))
    with pytest.raises(ModelLoadError, match="holds no .safetensors weights"):
        LLM(checkpoint, device="cpu")


@pytest.mark.parametrize("fraction", [0.5, 0.001])
def test_truncated_safetensors(checkpoint, fraction):
    path = os.path.join(checkpoint, "model.safetensors")
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: int(len(data) * fraction)])
    with pytest.raises(ModelLoadError, match="cannot read safetensors file") as info:
        LLM(checkpoint, device="cpu", max_model_len=64)
    assert "model.safetensors" in str(info.value)


def _rewrite_weights(folder: str, edit) -> None:
    from safetensors.torch import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def test_weight_with_wrong_shape(checkpoint):
    name = "model.layers.1.mlp.up_proj.weight"
    _rewrite_weights(checkpoint, lambda t: t.update({name: t[name].T.contiguous()}))
    with pytest.raises(ModelLoadError, match=rf"weight '{name}' has shape \(64, 128\), expected \(128, 64\)"):
        LLM(checkpoint, device="cpu", max_model_len=64)


def test_weight_with_unknown_name(checkpoint):
    import torch

    name = "model.layers.0.self_attn.extra_proj.weight"
    _rewrite_weights(checkpoint, lambda t: t.update({name: torch.zeros(8, 8)}))
    with pytest.raises(ModelLoadError, match=f"unexpected weight '{name}'"):
        LLM(checkpoint, device="cpu", max_model_len=64)


def test_missing_weight(checkpoint):
    name = "model.layers.0.self_attn.k_proj.weight"
    _rewrite_weights(checkpoint, lambda t: t.pop(name))
    with pytest.raises(ModelLoadError, match="missing weights") as info:
        LLM(checkpoint, device="cpu", max_model_len=64)
    assert name in str(info.value)


# -- prompts -----------------------------------------------------------------------------


def test_prompt_longer_than_max_model_len(llm):
    assert llm.max_model_len == 1024
    with pytest.raises(PromptTooLongError, match="max_model_len") as info:
        llm.generate([[100] * 1500], GREEDY, use_tqdm=False)
    assert "1500 tokens" in str(info.value)
    assert isinstance(info.value, InvalidRequestError)


def test_prompt_exactly_max_model_len(llm):
    # The context must also hold one generated token, so a 1024-token prompt does not fit...
    with pytest.raises(PromptTooLongError, match="1024 tokens"):
        llm.add_request([100] * 1024, GREEDY)
    assert not llm.has_unfinished_requests()


def test_text_prompt_too_long(llm):
    prompt = "hello " * 1500
    assert len(llm.tokenizer.encode(prompt)) > 1024
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.generate(prompt, GREEDY, use_tqdm=False)


def test_chat_prompt_too_long(llm):
    messages = [{"role": "user", "content": "hello " * 1500}]
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.chat(messages, GREEDY, use_tqdm=False)


def test_compute_logits_prompt_too_long(llm):
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        llm.compute_logits([100] * 2000)


@pytest.mark.parametrize("prompt", ["", [], {"prompt_token_ids": []}, {"prompt": ""}],
                         ids=["empty-str", "empty-list", "empty-ids-dict", "empty-text-dict"])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="Prompt cannot be empty"):  # vLLM's test_prompt_validation matches this
        llm.add_request(prompt, GREEDY)
    assert not llm.has_unfinished_requests()


def test_empty_prompt_in_generate(llm):
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate(["", "hello"], GREEDY, use_tqdm=False)


@pytest.mark.parametrize("bad", [49152, 10**9, -1, True, 1.5], ids=["vocab", "huge", "negative", "bool", "float"])
def test_token_ids_out_of_vocab(llm, bad):
    assert llm.runner.model_config.vocab_size == 49152
    with pytest.raises(InvalidRequestError, match=r"token ids must be ints in \[0, 49152\)"):
        llm.generate([[1, 2, bad]], GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match=rf"token id {bad!r} is out of vocabulary"):  # vLLM's phrase
        llm.generate([[1, 2, bad]], GREEDY, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="token ids"):
        llm.add_request({"prompt_token_ids": [bad, 5]}, GREEDY)
    assert not llm.has_unfinished_requests()


@pytest.mark.parametrize("prompt", [42, None, {"text": "hi"}], ids=["int", "none", "dict-without-prompt"])
def test_prompt_of_wrong_type(llm, prompt):
    with pytest.raises(InvalidRequestError, match="prompt"):
        llm.add_request(prompt, GREEDY)


@pytest.mark.parametrize("call", [
    pytest.param(lambda e: e.generate(None, GREEDY, use_tqdm=False), id="generate-None"),
    pytest.param(lambda e: e.generate(42, GREEDY, use_tqdm=False), id="generate-int"),
    pytest.param(lambda e: e.chat(None, GREEDY, use_tqdm=False), id="chat-None"),
    pytest.param(lambda e: e.generate([[1, 2], 42], GREEDY, use_tqdm=False), id="generate-int-among-prompts"),
    pytest.param(lambda e: e.generate([None], GREEDY, use_tqdm=False), id="generate-list-of-None"),
    pytest.param(lambda e: e.chat([{"role": "user", "content": 5}], GREEDY, use_tqdm=False), id="chat-bad-content"),
    pytest.param(lambda e: e.chat(["hello"], GREEDY, use_tqdm=False), id="chat-str-message"),
])
def test_prompts_argument_of_wrong_type(llm, call):
    with pytest.raises(InvalidRequestError, match="prompt|messages"):
        call(llm)
    assert not llm.has_unfinished_requests()


def test_sampling_params_of_wrong_type(llm):
    with pytest.raises(InvalidRequestError, match="must be a SamplingParams"):
        llm.generate("hello", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="must be a SamplingParams"):
        llm.add_request("hello", {"temperature": 0})


def test_params_list_length_mismatch(llm):
    with pytest.raises(InvalidRequestError, match="2 sampling params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)


def test_duplicate_request_id(llm):
    llm.add_request("hello", GREEDY, request_id="dup")
    try:
        with pytest.raises(InvalidRequestError, match="'dup' is already in use"):
            llm.add_request("hello again", GREEDY, request_id="dup")
    finally:
        llm.abort_request("dup")
        llm.step()  # surfaces (and drops) the aborted request
    assert not llm.has_unfinished_requests()


def test_bad_prompt_rejects_whole_call_and_engine_recovers(llm):
    good = ["The capital of Italy is", "One, two, three,"]
    expected = [o.outputs[0].token_ids for o in llm.generate(good, GREEDY, use_tqdm=False)]
    pool = llm.scheduler.pool
    bad_batches = [
        [good[0], [100] * 2000, good[1]],                     # too long, in the middle
        [good[0], good[1], ""],                              # empty, at the end
        [good[0], {"prompt_token_ids": [1, 10**6]}, good[1]],  # out of vocab
    ]
    for batch in bad_batches:
        with pytest.raises(InvalidRequestError):
            llm.generate(batch, GREEDY, use_tqdm=False)
        # Nothing of the rejected call was queued: no request, no KV block.
        assert not llm.has_unfinished_requests()
        assert pool.num_free == pool.num_blocks
    with pytest.raises(PromptTooLongError):
        llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "hello " * 1500}]],
                 GREEDY, use_tqdm=False)
    assert not llm.has_unfinished_requests()
    outs = llm.generate(good, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert len({o.request_id for o in outs}) == len(outs)
    assert pool.num_free == pool.num_blocks


def test_rejected_generate_keeps_queued_request(llm):
    """A request accepted by add_request is untouched by a later generate() call that is rejected."""
    expected = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    llm.add_request("Hello", GREEDY, request_id="queued")
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        llm.generate(["hi", ""], GREEDY, use_tqdm=False)
    assert llm.has_unfinished_requests()
    outs = []
    while llm.has_unfinished_requests():
        outs += llm.step()
    assert [o.request_id for o in outs] == ["queued"]
    assert outs[0].outputs[0].token_ids == expected


def test_generate_does_not_swallow_queued_request(llm):
    llm.add_request("Hello", GREEDY, request_id="queued-2")
    outs = llm.generate(["hi"], GREEDY, use_tqdm=False)
    for _ in range(8):
        outs += llm.step()
    assert "queued-2" in [o.request_id for o in outs]


# -- sampling parameters -----------------------------------------------------------------


@pytest.mark.parametrize("kwargs, names", [
    (dict(temperature=-1), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="hot"), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(top_k=2.5), "top_k"),
    (dict(min_p=2), "min_p"),
    (dict(min_p=-0.1), "min_p"),
    (dict(n=0), "n must"),
    (dict(n=True), "n must"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens (5) must not exceed max_tokens (2)"),
    (dict(stop=[1]), "stop must be"),
    (dict(stop=""), "stop strings must not be empty"),
    (dict(stop=["ok", ""]), "stop strings must not be empty"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop_token_ids=[1.0]), "stop_token_ids"),
    (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(seed="x"), "seed"),
    (dict(seed=1.5), "seed"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_invalid_sampling_params(kwargs, names):
    with pytest.raises(InvalidRequestError, match=names.replace("(", r"\(").replace(")", r"\)")) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, TidyrunError)


def test_valid_sampling_params_edges():
    """Control: the boundary values next to the rejected ones are accepted."""
    SamplingParams(temperature=0, top_p=1.0, top_k=-1, min_p=1.0, n=1, max_tokens=1, min_tokens=1,
                   stop=["x"], stop_token_ids=[0], seed=0)
    SamplingParams(top_k=0, min_p=0.0, max_tokens=None, min_tokens=100, stop="x", stop_token_ids=None)


# -- engine configuration ----------------------------------------------------------------


def test_bad_dtype(default_model):
    with pytest.raises(InvalidRequestError, match="dtype must be one of") as info:
        LLM(default_model, device="cpu", dtype="int8")
    assert "'int8'" in str(info.value)


@pytest.mark.parametrize("kwargs, message", [
    (dict(max_model_len=1), "max_model_len must be > 1"),
    (dict(max_num_seqs=0), "max_num_seqs must be positive"),
    (dict(block_size=12), "block_size must be a positive power of two"),
    (dict(num_kv_blocks=0), "num_blocks must be positive"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be in"),
    (dict(device="tpu"), "invalid device 'tpu'"),
    (dict(device="mps"), "device type 'mps' is not supported"),
    # Wrong types name the keyword (they failed with a bare TypeError comparing a str with a number)
    (dict(gpu_memory_utilization="0.5"), r"gpu_memory_utilization must be a number, got '0.5' \(str\)"),
    (dict(max_model_len="1k"), r"max_model_len must be an int, got '1k' \(str\)"),
    (dict(seed="a"), r"seed must be an int, got 'a' \(str\)"),
    (dict(max_num_seqs=2.5), r"max_num_seqs must be an int, got 2.5"),
], ids=lambda v: repr(v) if isinstance(v, dict) else None)
def test_bad_engine_arguments(pristine_checkpoint, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(pristine_checkpoint, **{"device": "cpu", **kwargs})


def test_max_model_len_beyond_model_context(default_model):
    with pytest.raises(InvalidRequestError, match=r"max_model_len=9000 exceeds the model's context length \(8192\)"):
        LLM(default_model, device="cpu", max_model_len=9000)


def test_kv_cache_too_small(default_model):
    with pytest.raises(OutOfResourcesError, match="max_model_len=256") as info:
        LLM(default_model, device="cpu", num_kv_blocks=2, block_size=16, max_model_len=256)
    assert "2 blocks (32 tokens)" in str(info.value)


# -- after shutdown ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dead_llm(default_model):
    engine = LLM(default_model, device="cpu", max_model_len=256)
    out = engine.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(out.token_ids) == 4  # it worked before shutdown
    engine.add_request("a request still in flight", SamplingParams(max_tokens=50))
    engine.step()
    engine.shutdown()
    engine.shutdown()  # twice is fine
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("call", [
    lambda e: e.generate("Hello", GREEDY, use_tqdm=False),
    lambda e: e.chat([{"role": "user", "content": "Hi"}], GREEDY, use_tqdm=False),
    lambda e: e.add_request("Hello", GREEDY),
    lambda e: e.step(),
    lambda e: e.abort_request("0"),
    lambda e: next(iter(e.stream("Hello", GREEDY))),
    lambda e: e.compute_logits("Hello"),
], ids=["generate", "chat", "add_request", "step", "abort_request", "stream", "compute_logits"])
def test_calls_after_shutdown(dead_llm, call):
    with pytest.raises(EngineShutdownError, match="shut down") as info:
        call(dead_llm)
    assert isinstance(info.value, RuntimeError)


@pytest.mark.parametrize("attr", ["max_model_len", "device", "dtype"])
def test_properties_after_shutdown(dead_llm, attr):
    with pytest.raises(EngineShutdownError, match="shut down"):
        getattr(dead_llm, attr)


def test_shutdown_aborted_in_flight_requests(dead_llm):
    assert not dead_llm.has_unfinished_requests()
    dead_llm.shutdown()  # and a third time


@pytest.mark.parametrize("kwargs,message", [
    (dict(cuda_graph_sizes=[]), "cuda_graph_sizes"),
    (dict(cuda_graph_sizes=[0, 8]), "cuda_graph_sizes"),
    (dict(cuda_graph_sizes="8"), "cuda_graph_sizes"),
    (dict(kernels="flash"), "kernels"),
    (dict(enforce_eager="yes"), "enforce_eager"),
    (dict(batch_invariant="yes"), "batch_invariant"),
])
def test_gpu_execution_options_are_validated(checkpoint, kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        LLM(checkpoint, device="cpu", **kwargs)


def test_triton_kernels_need_cuda(checkpoint):
    with pytest.raises(InvalidRequestError, match="needs a CUDA device"):
        LLM(checkpoint, device="cpu", kernels="triton")


def test_batch_invariance_is_refused_where_it_is_not_verified(tmp_path, hf_tokenizer_dir):
    from conftest import write_tiny_checkpoint
    from test_architectures import ARCHS

    moe = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, **ARCHS["olmoe"])
    with pytest.raises(InvalidRequestError, match="not available for mixture-of-experts models"):
        LLM(moe, device="cpu", batch_invariant=True)
    with pytest.raises(InvalidRequestError, match="not available with tensor_parallel_size > 1"):
        LLM(moe, device="cpu", batch_invariant=True, tensor_parallel_size=2)


def test_batch_invariance_needs_the_triton_kernels(checkpoint, monkeypatch):
    """Asked for by keyword or by vLLM's environment switch, it is refused on the CPU rather than ignored."""
    with pytest.raises(InvalidRequestError, match="batch_invariant=True needs the Triton kernels"):
        LLM(checkpoint, device="cpu", batch_invariant=True)
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    with pytest.raises(InvalidRequestError, match="batch_invariant=True needs the Triton kernels"):
        LLM(checkpoint, device="cpu")
    LLM(checkpoint, device="cpu", batch_invariant=False).shutdown()  # the keyword wins over the environment
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "yes")
    with pytest.raises(InvalidRequestError, match="VLLM_BATCH_INVARIANT must be '0' or '1', got 'yes'"):
        LLM(checkpoint, device="cpu")


def test_text_that_is_not_unicode_is_a_clear_error(tiny_llama_dir):
    """A lone surrogate (JSON can carry "\\ud800") used to reach the tokenizer and raise a bare TypeError."""
    with LLM(tiny_llama_dir, device="cpu", max_model_len=64) as llm:
        with pytest.raises(InvalidRequestError, match=r"prompt is not valid Unicode: surrogates not allowed at "
                                                       r"character 1 \('\\ud800'\)"):
            llm.generate("a\ud800b", use_tqdm=False)
        template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
        with pytest.raises(InvalidRequestError, match="not valid Unicode"):
            llm.chat([{"role": "user", "content": "x\udfff"}], chat_template=template, use_tqdm=False)
        assert llm.generate("still serving", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
