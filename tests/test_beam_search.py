"""``LLM.beam_search`` (vLLM's offline beam search): transformers' beam search on the same weights, greedy at
width 1, EOS handling, vLLM's score, bad parameters refused by name."""

from __future__ import annotations

import pytest
import torch

from tidyrun import LLM, BeamSearchParams, InvalidRequestError, SamplingParams
from tidyrun.beam_search import score

PROMPT = [5, 17, 300, 42]


@pytest.fixture(scope="module")
def engines(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    llm = LLM(tiny_llama_dir, device="cpu", dtype="float32", max_model_len=64, kv_cache_memory=4 << 20)
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    yield llm, hf
    llm.shutdown()


@pytest.mark.parametrize("width", [1, 2, 4])
def test_beams_are_transformers_beams(engines, width):
    """Without EOS every beam has the same length, so the best beams are those of transformers' beam search
    (the same 2 * width candidates per beam, kept by summed logprob), best first."""
    llm, hf = engines
    [out] = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(beam_width=width, max_tokens=6,
                                                                            ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), num_beams=width, num_return_sequences=width, do_sample=False,
                          max_new_tokens=6, min_new_tokens=6, early_stopping=False, eos_token_id=None, pad_token_id=0)
    assert [s.tokens for s in out.sequences] == ref.tolist()
    scores = [score(s, 2, 1.0) for s in out.sequences]
    assert scores == sorted(scores, reverse=True) and len(out.sequences) == width
    for s in out.sequences:
        chosen = [lp[t].logprob for lp, t in zip(s.logprobs, s.tokens[len(PROMPT):])]
        assert s.cum_logprob == pytest.approx(sum(chosen), abs=1e-5)
        assert s.text == llm.get_tokenizer().decode(s.tokens)  # prompt and generated, special tokens kept
        assert (s.finish_reason, s.stop_reason) == (None, None)  # as vLLM's offline beam search leaves them
    if width == 1:
        greedy = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=6,
                                                                           ignore_eos=True), use_tqdm=False)
        assert out.sequences[0].tokens == PROMPT + list(greedy[0].outputs[0].token_ids)


def test_eos_ends_a_beam_and_prompts_run_together(engines):
    """A beam whose candidate is the tokenizer's EOS id is finished with it (it is never extended); several
    prompts come back in order, each with its own beams."""
    llm, _ = engines
    eos = llm.get_tokenizer().eos_token_id
    params = BeamSearchParams(beam_width=3, max_tokens=5)
    outs = llm.beam_search([PROMPT, "Hello there", {"prompt": "A"}], params)
    assert len(outs) == 3 and outs[0].sequences[0].tokens[:4] == PROMPT
    assert all(len(o.sequences) == 3 for o in outs)
    for out in outs:
        for s in out.sequences:
            generated = s.tokens[-len(s.logprobs):]
            assert eos not in generated[:-1] and (generated[-1] == eos or len(generated) == 5)
    assert not llm.has_unfinished_requests()


def test_bad_beam_search_parameters_are_refused(engines):
    llm, _ = engines
    for params, match in [(BeamSearchParams(beam_width=0, max_tokens=4), "beam_width must be an int >= 1"),
                          (BeamSearchParams(beam_width=11, max_tokens=4), r"22 logprobs.*max_logprobs \(20\)"),
                          (BeamSearchParams(beam_width=2, max_tokens=4, temperature=-1), "temperature must be >= 0")]:
        with pytest.raises(InvalidRequestError, match=match):
            llm.beam_search([PROMPT], params)
    with pytest.raises(InvalidRequestError, match="takes a BeamSearchParams"):
        llm.beam_search([PROMPT], SamplingParams())
    with pytest.raises(InvalidRequestError, match="a prompt or a non-empty list"):
        llm.beam_search(None, BeamSearchParams(beam_width=2, max_tokens=2))
    with pytest.raises(InvalidRequestError, match="lora_request"):
        llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=2), lora_request="adapter")
