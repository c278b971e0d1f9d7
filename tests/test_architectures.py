"""Architectures beyond Llama (CPU, fp32): each tiny random checkpoint written by transformers gives
transformers' logits and greedy tokens, the same tokens batched as alone, and after update_weights with
perturbed weights the same logits as a fresh engine on the perturbed checkpoint.

The checkpoints perturb every 1-D weight too (norms, biases), so a per-head norm that is loaded into the
wrong place or skipped changes the logits.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from conftest import write_tiny_checkpoint
from test_reference import assert_matches_reference
from tidyrun import LLM, SamplingParams

PROMPTS = ["Hello there, how are you doing today? I am fine.", "def fibonacci(n):", "The capital of"]
ARCHS = {
    # Qwen3: q_norm/k_norm per head before RoPE, head_dim set apart from hidden/heads, no q/k/v bias.
    "qwen3": dict(arch="qwen3", head_dim=32, tie_word_embeddings=True),
    # Phi-3: qkv_proj and gate_up_proj fused in the checkpoint; longrope (short factors inside the original
    # context, cos/sin scaled by the attention factor of max / original positions).
    "phi3": dict(arch="phi3", max_position_embeddings=1024, original_max_position_embeddings=256,
                 rope_scaling={"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(8)],
                               "long_factor": [2.0 + 0.5 * i for i in range(8)]}),
    # Gemma 3: a windowed layer (window 8, shorter than the prompts plus their outputs; local RoPE base) and a
    # global one (its own base, linear scaling); (1 + w) norms, four per layer; GeGLU; scaled embeddings.
    "gemma3": dict(arch="gemma3_text", head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
                   layer_types=["sliding_attention", "full_attention"], max_position_embeddings=256,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
    # Mixtral: 2 of 4 experts, chosen weights renormalized, Mixtral's names (block_sparse_moe, w1/w2/w3).
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2),
    # Qwen3-MoE: per-head q/k norms, experts narrower than the dense MLP of its mlp_only_layers (layer 1).
    "qwen3_moe": dict(arch="qwen3_moe", head_dim=32, num_experts=8, num_experts_per_tok=3, moe_intermediate_size=48,
                      norm_topk_prob=True, mlp_only_layers=[1]),
    # OLMoE: q/k norms over the whole projection, 3 of 8 experts, weights not renormalized.
    "olmoe": dict(arch="olmoe", num_experts=8, num_experts_per_tok=3),
}


@pytest.fixture(scope="module", params=sorted(ARCHS))
def checkpoint(request, tmp_path_factory, hf_tokenizer_dir):
    kw = ARCHS[request.param]
    return write_tiny_checkpoint(str(tmp_path_factory.mktemp(request.param)), hf_tokenizer_dir,
                                 perturb_vectors=True, **kw)


def test_logits_and_greedy_tokens_equal_transformers(checkpoint):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with LLM(checkpoint, device="cpu", dtype="float32") as engine:
        assert_matches_reference(engine, ref, engine.tokenizer.encode(PROMPTS[0]))


def test_batched_equals_alone(checkpoint):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(checkpoint, device="cpu", dtype="float32") as engine:
        batched = [o.outputs[0].token_ids for o in engine.generate(PROMPTS, params, use_tqdm=False)]
        alone = [engine.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone


def test_speculation_and_the_prefix_cache_change_no_token(checkpoint):
    """n-gram speculation (several positions verified per step) and prompts read back from the prefix cache
    give the plain engine's greedy tokens. The second prompt repeats the first after its own continuation,
    which gives the n-gram lookup earlier occurrences to draft from (the test checks that drafts were made)."""
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    with LLM(checkpoint, device="cpu", dtype="float32", enable_prefix_caching=False) as plain:
        first = plain.tokenizer.encode(PROMPTS[0])
        out = plain.generate({"prompt_token_ids": first}, params, use_tqdm=False)[0].outputs[0].token_ids
        prompts = [{"prompt_token_ids": first}, {"prompt_token_ids": first + out + first}]
        want = [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    with LLM(checkpoint, device="cpu", dtype="float32",
             speculative={"num_speculative_tokens": 4, "prompt_lookup_max": 3}) as fast:
        for _ in range(2):  # the second round finds the prompts' blocks in the prefix cache
            assert [o.outputs[0].token_ids for o in fast.generate(prompts, params, use_tqdm=False)] == want
        stats = fast.stats()
    assert stats["prefix_cached_tokens"] > 0 and stats["spec_draft_tokens"] > 0, stats


def test_update_weights_equals_a_fresh_engine(checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    import glob
    import os
    import shutil

    perturbed = str(tmp_path / "perturbed")
    shutil.copytree(checkpoint, perturbed)
    [path] = glob.glob(os.path.join(perturbed, "*.safetensors"))
    gen = torch.Generator().manual_seed(5)
    weights = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in load_file(path).items()}
    save_file(weights, path, metadata={"format": "pt"})
    ids = None
    with LLM(perturbed, device="cpu", dtype="float32") as fresh:
        ids = fresh.tokenizer.encode(PROMPTS[0])
        want = fresh.compute_logits(ids)
    with LLM(checkpoint, device="cpu", dtype="float32") as engine:
        before = engine.compute_logits(ids)
        assert engine.update_weights(weights) == len(weights)
        after = engine.compute_logits(ids)
    assert (before - want).abs().max() > 1e-2  # the perturbation shows
    assert torch.allclose(after, want, atol=1e-5, rtol=0)


def test_a_trainers_named_parameters_update_the_engine(checkpoint, tmp_path):
    """What an RL trainer pushes: a transformers model's ``named_parameters()``, under its in-memory names
    (transformers >= 5 stacks the experts: ``mlp.experts.gate_up_proj`` [E, 2I, H]), after a training step;
    the engine then equals a fresh one on the trained model's saved checkpoint."""
    from transformers import AutoModelForCausalLM

    trainer = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in trainer.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    trainer.save_pretrained(str(tmp_path))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(checkpoint, f), str(tmp_path))
    with LLM(str(tmp_path), device="cpu", dtype="float32") as fresh:
        ids = fresh.tokenizer.encode(PROMPTS[1])
        want = fresh.compute_logits(ids)
    with LLM(checkpoint, device="cpu", dtype="float32") as engine:
        engine.update_weights(trainer.named_parameters())
        got = engine.compute_logits(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_tensor_parallel_matches_one_rank(checkpoint):
    """Split over 2 CPU ranks (heads and intermediate channels; per-head norms replicated): same logits."""
    with LLM(checkpoint, device="cpu", dtype="float32") as single:
        ids = single.tokenizer.encode(PROMPTS[0])
        want = single.compute_logits(ids)
    with LLM(checkpoint, device="cpu", dtype="float32", tensor_parallel_size=2) as split:
        got = split.compute_logits(ids)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4)


GEMMA3_GGUF = dict(arch="gemma3_text", head_dim=16, query_pre_attn_scalar=16, sliding_window=8, num_hidden_layers=6,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"], max_position_embeddings=256,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})


@pytest.mark.parametrize("name,kw", [("qwen3", ARCHS["qwen3"]), ("gemma3", GEMMA3_GGUF)])
def test_gguf_reads_as_the_hf_folder(tmp_path, hf_tokenizer_dir, name, kw):
    """A GGUF written with the gguf package's own HF -> GGUF name map (float32, with llama.cpp's conventions:
    Gemma's norm weights stored as 1 + w, its layer pattern and local RoPE base implied) gives the same config
    and the same HF-named tensors as the Hugging Face folder it came from."""
    import json
    import os

    import gguf
    from safetensors.torch import load_file

    from tidyrun.loader import open_model_source
    from tidyrun.loader.gguf import GGUFSource

    folder = write_tiny_checkpoint(str(tmp_path / "hf"), hf_tokenizer_dir, perturb_vectors=True, **kw)
    raw = json.load(open(os.path.join(folder, "config.json")))
    weights = load_file(os.path.join(folder, "model.safetensors"))
    path = str(tmp_path / f"tiny-{name}.gguf")
    arch = gguf.MODEL_ARCH.QWEN3 if name == "qwen3" else gguf.MODEL_ARCH.GEMMA3
    writer = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(raw["num_hidden_layers"])
    writer.add_context_length(raw["max_position_embeddings"])
    writer.add_embedding_length(raw["hidden_size"])
    writer.add_feed_forward_length(raw["intermediate_size"])
    writer.add_head_count(raw["num_attention_heads"])
    writer.add_head_count_kv(raw["num_key_value_heads"])
    writer.add_key_length(raw["head_dim"])
    writer.add_value_length(raw["head_dim"])
    writer.add_layer_norm_rms_eps(raw["rms_norm_eps"])
    writer.add_vocab_size(raw["vocab_size"])
    rope = raw.get("rope_parameters") or {}
    if name == "gemma3":
        writer.add_sliding_window(raw["sliding_window"])
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["full_attention"]["factor"])
    else:
        writer.add_rope_freq_base(raw.get("rope_theta", rope.get("rope_theta", 1e6)))
    names = gguf.get_tensor_name_map(arch, raw["num_hidden_layers"])
    for hf_name, tensor in weights.items():
        data = tensor.float()
        if name == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1.0
        writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight", ".bias")), data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    source, reference = GGUFSource(path), open_model_source(folder)
    for field in ("architecture", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "vocab_size", "tie_word_embeddings", "attention_bias", "qk_norm", "rope_theta",
                  "rope_scaling", "sliding_windows", "rope_local_theta", "query_pre_attn_scalar"):
        assert getattr(source.config, field) == getattr(reference.config, field), field
    got = dict(source.iter_weights())
    assert got.keys() == weights.keys()
    for hf_name, tensor in weights.items():
        assert torch.allclose(got[hf_name], tensor.float(), atol=1e-6, rtol=0), hf_name


def test_dummy_weights_cover_every_parameter(checkpoint):
    """load_format="dummy" builds the same names and shapes the checkpoint has (fused, per-head norms)."""
    from safetensors.torch import load_file

    import glob

    from tidyrun.loader.dummy import checkpoint_shapes
    from tidyrun.loader import open_model_source

    [path] = glob.glob(f"{checkpoint}/*.safetensors")
    real = {k: tuple(v.shape) for k, v in load_file(path).items()}
    cfg = open_model_source(checkpoint).config
    assert checkpoint_shapes(cfg) == real
    with LLM(checkpoint, device="cpu", dtype="float32", load_format="dummy") as engine:
        assert len(engine.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)[0]
                   .outputs[0].token_ids) == 2


def test_phi3_longrope_context_stops_at_the_original_length(tmp_path, hf_tokenizer_dir):
    """Inside the original context transformers uses the short factors for every position, which a table
    reproduces exactly; beyond it the factors change for the whole sequence, so the context ends there."""
    from tidyrun import PromptTooLongError

    path = write_tiny_checkpoint(str(tmp_path), hf_tokenizer_dir, **ARCHS["phi3"])
    with LLM(path, device="cpu", dtype="float32") as engine:
        assert engine.max_model_len == 256
        with pytest.raises(PromptTooLongError):
            engine.generate({"prompt_token_ids": [5] * 300}, SamplingParams(max_tokens=1), use_tqdm=False)
