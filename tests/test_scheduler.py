"""The scheduler books a step's output by itself: no engine, no model, no tokenizer files."""

from __future__ import annotations

from tidyrun.kv_cache import BlockPool
from tidyrun.sampling_params import SamplingParams
from tidyrun.scheduler import Scheduler
from tidyrun.sequence import SampledTokens, Sequence, StepOutput
from tidyrun.tokenizer import Tokenizer

EOS = 2
BLOCK = 4


class LetterTokenizer:
    """Token i decodes to the letter chr(97 + i % 26): enough for detokenizing and stop strings."""

    eos_token_id = EOS

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + i % 26) for i in ids)


TOKENIZER = Tokenizer(LetterTokenizer())


def output(sampled: list[tuple[Sequence, list[int]]]) -> StepOutput:
    """A runner step's output: these sequences' new tokens, no logprobs."""
    return StepOutput([SampledTokens(seq, tokens) for seq, tokens in sampled], [])

def make_scheduler(propose=None, max_num_batched_tokens: int = 64) -> Scheduler:
    return Scheduler(BlockPool(32), BLOCK, max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens,
                     propose=propose)


def make_seq(scheduler: Scheduler, seq_id: int, prompt: list[int], **params) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", 0, prompt, SamplingParams(temperature=0, **params), TOKENIZER, None)
    scheduler.add(seq)
    return seq


def test_update_from_output_finishes_on_eos_stop_and_max_tokens():
    s = make_scheduler()
    by_eos = make_seq(s, 0, [5, 6, 7, 8, 9])
    by_length = make_seq(s, 1, [5, 6], max_tokens=2)
    by_stop_string = make_seq(s, 2, [8, 9], stop=["de"])  # tokens 3, 4 read "de"
    by_stop_token = make_seq(s, 3, [8, 9], stop_token_ids=[7])
    running = make_seq(s, 4, [10, 11, 12])
    seqs = [by_eos, by_length, by_stop_string, by_stop_token, running]

    def step(tokens: list[int]) -> set[str]:  # one sampled token per sequence, in ``seqs`` order
        batch = s.schedule()
        token_of = {q.seq_id: t for q, t in zip(seqs, tokens)}
        return s.update_from_output(batch, output([(q, [token_of[q.seq_id]]) for q in batch.seqs]), {EOS}, 64)

    assert step([20, 20, 3, 20, 3]) == set()  # every prompt prefills
    assert [q.num_computed_tokens for q in seqs] == [5, 2, 2, 2, 3]
    assert s.pool.num_cached == 1  # by_eos's first full block went to the prefix cache

    finished = step([EOS, 21, 4, 7, 22])  # one decode token each

    assert finished == {"r0", "r1", "r2", "r3"}
    assert [(q.finish_reason, q.stop_reason) for q in seqs[:4]] == [("stop", None), ("length", None),
                                                                   ("stop", "de"), ("stop", 7)]
    assert by_eos.output_token_ids == [20, EOS] and by_eos.text == "u"  # the stop token is not text
    assert by_stop_string.text == "" and by_length.text == "uv"
    assert s.running == [running] and not running.is_finished and running.num_computed_tokens == 4
    assert s.pool.num_free == s.pool.num_blocks - len(running.block_table)  # finished sequences gave theirs back


def test_update_from_output_finishes_at_max_model_len():
    s = make_scheduler()
    seq = make_seq(s, 0, [5, 6, 7], max_tokens=None)
    for token in (20, 21):
        s.update_from_output(s.schedule(), output([(seq, [token])]), {EOS}, max_model_len=5)
    assert seq.finish_reason == "length" and seq.num_tokens == 5 and not s.running


def test_a_prefill_chunk_only_advances():
    s = make_scheduler(max_num_batched_tokens=4)
    seq = make_seq(s, 0, list(range(10, 20)))
    batch = s.schedule()
    assert batch.num_new_tokens == [4]
    assert s.update_from_output(batch, output([]), {EOS}, 64) == set()
    assert seq.num_computed_tokens == 4 and seq.output_token_ids == [] and seq.num_registered_blocks == 1


def test_update_from_output_counts_speculation():
    s = make_scheduler(propose=lambda seq, limit: [30, 31, 32][:limit])
    seq = make_seq(s, 0, [5, 6, 7], max_tokens=20)
    s.update_from_output(s.schedule(), output([(seq, [30])]), {EOS}, 64)  # prefill: no drafts yet

    batch = s.schedule()
    assert seq.draft_tokens == [30, 31, 32] and batch.num_new_tokens == [4]
    s.update_from_output(batch, output([(seq, [30, 31, 9])]), {EOS}, 64)  # two drafts accepted, then the model's own

    assert (s.num_spec_draft_tokens, s.num_spec_accepted_tokens) == (3, 2)
    assert seq.output_token_ids == [30, 30, 31, 9] and seq.draft_tokens == []
    assert seq.num_computed_tokens == seq.num_tokens - 1  # up to the model's own token, computed next step
