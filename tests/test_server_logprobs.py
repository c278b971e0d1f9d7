"""The server's logprobs shapes and stream deltas, built from hand-made engine outputs (no model, no HTTP).

These pin OpenAI's two logprobs formats and the rule that a stream's deltas
add up to the whole response; the end-to-end tests against a real server are
in test_server_openai.py.
"""

from __future__ import annotations

import json
import math

import pytest

from tidyrun.logprobs import Logprob
from tidyrun.outputs import CompletionOutput, RequestOutput
from tidyrun.server.choices import ChatChoices, CompletionChoices
from tidyrun.server.logprobs_format import FLOOR, TokenText, chat_logprobs, completion_logprobs, prompt_logprobs_json
from tidyrun.synthetic import write_tokenizer
from tidyrun.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> TokenText:
    from transformers import AutoTokenizer

    folder = str(tmp_path_factory.mktemp("tok"))
    write_tokenizer(folder)
    return TokenText(Tokenizer(AutoTokenizer.from_pretrained(folder)))


def lp(logprob: float, rank: int, text: str) -> Logprob:
    return Logprob(logprob, rank, text)


# Token ids of single ASCII characters in the test tokenizer (its byte-level alphabet has them all), so
# each hand-made Logprob's decoded_token is that token's real text. Resolved by the `texts` fixture.
IDS: dict[str, int] = {}


@pytest.fixture(autouse=True, scope="module")
def _ids(texts):
    hf = texts._tok.hf_tokenizer
    IDS.update({ch: hf.convert_tokens_to_ids(ch) for ch in "ABCPQRvwxyz"})
    assert len(set(IDS.values())) == len(IDS)


def steps() -> list[dict[int, Logprob]]:
    """Three generated tokens A, B, C; each step holds the chosen token and the top 2."""
    A, B, C, v, w, x, y, z = (IDS[ch] for ch in "ABCvwxyz")
    return [
        {A: lp(-0.1, 1, "A"), x: lp(-2.5, 2, "x")},  # chosen is the most likely
        {B: lp(-3.0, 3, "B"), y: lp(-0.2, 1, "y"), z: lp(-1.9, 2, "z")},  # chosen is third
        {C: lp(-math.inf, 7, "C"), w: lp(-0.01, 1, "w"), v: lp(-5.0, 2, "v")},  # chosen was masked out
    ]


def abc() -> list[int]:
    return [IDS["A"], IDS["B"], IDS["C"]]


def test_completion_shape_holds_the_chosen_token_and_the_top_k(texts):
    out = completion_logprobs(abc(), steps(), 2, texts, text_offset=5)
    assert out["tokens"] == ["A", "B", "C"]
    assert out["token_logprobs"] == [-0.1, -3.0, FLOOR]
    assert out["text_offset"] == [5, 6, 7]
    assert out["top_logprobs"][0] == {"A": -0.1, "x": -2.5}
    assert out["top_logprobs"][1] == {"y": -0.2, "z": -1.9, "B": -3.0}  # top 2 plus the chosen: k + 1 entries
    assert out["top_logprobs"][2] == {"w": -0.01, "v": -5.0, "C": FLOOR}
    json.dumps(out, allow_nan=False)  # no -inf reaches the wire
    only_chosen = completion_logprobs(abc(), steps(), 0, texts)
    assert only_chosen["top_logprobs"] == [{"A": -0.1}, {"B": -3.0}, {"C": FLOOR}]


def test_completion_shape_keeps_the_chosen_value_when_two_tokens_share_a_text(texts):
    step = {IDS["A"]: lp(-1.5, 2, "same"), IDS["x"]: lp(-0.5, 1, "same")}
    out = completion_logprobs([IDS["A"]], [step], 1, texts)
    assert out["top_logprobs"][0]["same"] == out["token_logprobs"][0] == -1.5


def test_missing_steps_are_null_in_the_completion_shape(texts):
    out = completion_logprobs(abc()[:2], [None, steps()[1]], 1, texts)
    assert out["token_logprobs"][0] is None and out["top_logprobs"][0] is None
    assert out["token_logprobs"][1] == -3.0
    assert out["tokens"][0] == "A"  # still named, decoded from the vocabulary


def test_chat_shape_lists_the_k_most_likely_whether_chosen_or_not(texts):
    out = chat_logprobs(abc(), steps(), 2, texts)["content"]
    assert [e["token"] for e in out] == ["A", "B", "C"]
    assert [e["logprob"] for e in out] == [-0.1, -3.0, FLOOR]
    assert [[t["token"] for t in e["top_logprobs"]] for e in out] == [["A", "x"], ["y", "z"], ["w", "v"]]
    assert out[1]["bytes"] == list(b"B") and out[1]["top_logprobs"][0]["bytes"] == list(b"y")
    assert all(e["top_logprobs"] == [] for e in chat_logprobs(abc(), steps(), 0, texts)["content"])


def test_bytes_of_half_a_character_are_the_real_bytes(texts):
    """A byte-level token holding the first byte of 'é' (0xC3) decodes to U+FFFD; its bytes stay 0xC3."""
    hf = texts._tok.hf_tokenizer
    token_id = hf.convert_tokens_to_ids("Ã")  # GPT-2's alphabet writes byte 0xC3 as 'Ã'
    text = texts.text(token_id)
    assert text == "\ufffd"
    assert texts.bytes(token_id, text) == [0xC3]
    ids = hf.encode("é", add_special_tokens=False)
    assert sum((texts.bytes(t, texts.text(t)) for t in ids), []) == list("é".encode())


def test_prompt_logprobs_extra_keys_token_ids(texts):
    A, B, y = IDS["A"], IDS["B"], IDS["y"]
    out = prompt_logprobs_json([A, B], [None, {B: lp(-2.0, 2, "B"), y: lp(-0.5, 1, "y")}], 1, texts)
    assert out == [None, {str(y): {"logprob": -0.5, "rank": 1, "decoded_token": "y"},
                          str(B): {"logprob": -2.0, "rank": 2, "decoded_token": "B"}}]
    assert prompt_logprobs_json([A, B], None, 1, texts) is None


# -- stream deltas add up to the whole ------------------------------------------------------------

def prompt() -> tuple[list[int], list]:
    """The prompt "PQ": its token ids and prompt logprobs (the first null: nothing predicts it)."""
    P, Q, R = IDS["P"], IDS["Q"], IDS["R"]
    return [P, Q], [None, {Q: lp(-1.25, 2, "Q"), R: lp(-0.5, 1, "R")}]


def outputs_over_time(stop_text: str | None = None) -> list[RequestOutput]:
    """Cumulative outputs of one choice generating A, B, C then finishing (cut at ``stop_text``)."""
    outs = []
    for n in range(1, 4):
        finished = n == 3
        text = "ABC"[:n]
        if finished and stop_text is not None:
            text = text[: text.index(stop_text)]
        c = CompletionOutput(0, text, abc()[:n], None, steps()[:n], "stop" if finished else None)
        outs.append(RequestOutput("r", "PQ", *prompt(), [c]))
    return outs


def stream(choices, outs) -> list[dict]:
    deltas = []
    for out in outs:
        d = choices.delta(out, out.outputs[0])
        if d is not None:
            deltas.append(d)
    return deltas


@pytest.mark.parametrize("echo", [False, True])
def test_completion_deltas_add_up_to_the_whole_choice(texts, echo):
    outs = outputs_over_time()
    whole = CompletionChoices(texts, [], 1, None, echo, "PQ").whole(outs[-1], outs[-1].outputs[0], 0)
    deltas = stream(CompletionChoices(texts, [], 1, None, echo, "PQ"), outs)
    assert "".join(d["text"] for d in deltas) == whole["text"] == ("PQ" if echo else "") + "ABC"
    for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
        assert sum((d["logprobs"][key] for d in deltas), []) == whole["logprobs"][key], key
    assert deltas[-1]["finish_reason"] == "stop" and all(d["finish_reason"] is None for d in deltas[:-1])
    if echo:
        assert whole["logprobs"]["tokens"][:2] == ["P", "Q"]
        assert whole["logprobs"]["token_logprobs"][:2] == [None, -1.25]
        assert whole["logprobs"]["text_offset"] == [0, 1, 2, 3, 4]


def test_text_that_may_start_a_stop_string_is_held_back_but_logprobs_are_not(texts):
    """As in vLLM: a token's logprob goes out with the first delta after it was generated, even while
    its text waits to see whether it starts a stop string (here it does: "BC" is cut)."""
    outs = outputs_over_time(stop_text="BC")
    deltas = stream(CompletionChoices(texts, ["BC"], 0, None, False, ""), outs)
    assert [d["text"] for d in deltas] == ["A", ""]
    assert [d["logprobs"]["tokens"] for d in deltas] == [["A", "B"], ["C"]]
    whole = CompletionChoices(texts, ["BC"], 0, None, False, "").whole(outs[-1], outs[-1].outputs[0], 0)
    assert sum((d["logprobs"]["text_offset"] for d in deltas), []) == whole["logprobs"]["text_offset"] == [0, 1, 2]


def test_score_only_echo_shows_the_prompt_alone(texts):
    outs = outputs_over_time()
    choices = CompletionChoices(texts, [], 0, None, True, "PQ", score_only=True)
    whole = choices.whole(outs[-1], outs[-1].outputs[0], 0)
    assert whole["text"] == "PQ" and whole["logprobs"]["token_logprobs"] == [None, -1.25]
    assert "".join(d["text"] for d in stream(CompletionChoices(texts, [], 0, None, True, "PQ", True), outs)) == "PQ"


def test_logprobs_the_engine_did_not_return_are_null_not_an_error(texts):
    c = CompletionOutput(0, "A", [IDS["A"]], None, None, "length")
    out = RequestOutput("r", "PQ", prompt()[0], None, [c])
    assert CompletionChoices(texts, [], 2, None, True, "PQ").whole(out, c, 0)["logprobs"] is None
    assert ChatChoices(texts, [], 2, None).whole(c)["logprobs"] is None


def test_chat_deltas_add_up_to_the_whole_choice(texts):
    outs = outputs_over_time()
    whole = ChatChoices(texts, [], 2, None).whole(outs[-1].outputs[0])
    deltas = stream(ChatChoices(texts, [], 2, None), outs)
    assert "".join(d["delta"].get("content", "") for d in deltas) == whole["message"]["content"] == "ABC"
    assert sum((d["logprobs"]["content"] for d in deltas), []) == whole["logprobs"]["content"]
    assert ChatChoices(texts, [], None, None).whole(outs[-1].outputs[0])["logprobs"] is None
