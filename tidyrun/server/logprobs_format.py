"""Logprobs in OpenAI's JSON shapes, built from the engine's per-token ``{token id: Logprob}`` dicts.

The engine gives, per token, a dict holding the sampled (or prompt) token and
the k most likely ones, each with its rank. OpenAI has two shapes for that:
the legacy completions one (parallel lists ``tokens`` / ``token_logprobs`` /
``top_logprobs`` / ``text_offset``, where ``top_logprobs`` maps token *text*
to logprob and always includes the chosen token) and the chat one (a list of
``{token, logprob, bytes, top_logprobs: [...]}``, where ``top_logprobs`` are
the k most likely, chosen or not). A missing entry (the first prompt token,
which nothing predicts) is null in the completions shape; the chat shape's
logprob is a required number, so it is FLOOR there, as in vLLM. JSON has no -inf: such logprobs are sent as -9999.0, as
OpenAI and vLLM do.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..logprobs import Logprob
from ..tokenizer import Tokenizer

FLOOR = -9999.0  # what -inf (a token masked out) is sent as

Step = dict[int, Logprob] | None


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (and NaN, which is never a valid logprob) become FLOOR."""
    return max(logprob, FLOOR) if math.isfinite(logprob) else FLOOR


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the character each byte is written as in the vocabulary -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """The text and the UTF-8 bytes of single tokens, as logprobs show them.

    A token's text is the engine's ``decoded_token`` when it has one, else the
    token decoded alone (special tokens included: they were generated). Its
    bytes come from the vocabulary itself for byte-level BPE tokenizers, so a
    token holding half of a multi-byte character still reports its real bytes
    (its text is then U+FFFD); other tokenizers report the text's UTF-8.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        hf = tokenizer.hf_tokenizer
        backend = getattr(hf, "backend_tokenizer", None)
        decoder = getattr(backend, "decoder", None)
        self._bytes_of = _byte_decoder() if type(decoder).__name__ == "ByteLevel" else None
        self._text: dict[int, str] = {}

    def text(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int, text: str) -> list[int]:
        if self._bytes_of is not None:
            raw = self._tok.hf_tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(raw, str) and raw and all(ch in self._bytes_of for ch in raw):
                return [self._bytes_of[ch] for ch in raw]
        return list(text.encode("utf-8", errors="replace"))


class TokenIdText(TokenText):
    """vLLM's ``return_tokens_as_token_ids``: every token shown as ``"token_id:<id>"`` (its bytes that string's),
    so a client can tell apart tokens whose texts are equal or not valid UTF-8 alone."""

    def text(self, token_id: int, logprob: Logprob | None = None) -> str:
        return f"token_id:{token_id}"

    def bytes(self, token_id: int, text: str) -> list[int]:
        return list(text.encode("utf-8"))


def _ranked(step: dict[int, Logprob]) -> list[tuple[int, Logprob]]:
    """The entries of one step, most likely first (by rank, then by logprob)."""
    return sorted(step.items(), key=lambda kv: (kv[1].rank is None, kv[1].rank or 0, -kv[1].logprob))


def completion_logprobs(token_ids: Sequence[int], steps: Sequence[Step], k: int, texts: TokenText,
                        text_offset: int = 0) -> dict:
    """The legacy completions shape for ``token_ids`` (steps[i] belongs to token_ids[i]; missing: null).

    ``top_logprobs[i]`` holds the ``k`` most likely tokens plus the chosen one
    (so up to k + 1 entries, as OpenAI documents); ``text_offset[i]`` is where
    token i's text starts, counting from ``text_offset``.
    """
    tokens, token_logprobs, top, offsets = [], [], [], []
    for i, token_id in enumerate(token_ids):
        step = steps[i] if i < len(steps) else None
        chosen = step.get(token_id) if step else None
        text = texts.text(token_id, chosen)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if chosen is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(finite(chosen.logprob))
        alternatives = {texts.text(t, lp): finite(lp.logprob) for t, lp in _ranked(step)[:k]}
        alternatives[text] = finite(chosen.logprob)  # the chosen token's own value wins a text collision
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], steps: Sequence[Step], k: int, texts: TokenText) -> dict:
    """The chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [k most likely]}, ...]}``."""
    content = []
    for i, token_id in enumerate(token_ids):
        step = steps[i] if i < len(steps) else None
        chosen = step.get(token_id) if step else None
        text = texts.text(token_id, chosen)
        top = [] if chosen is None else [
            {"token": (t_text := texts.text(t, lp)), "logprob": finite(lp.logprob), "bytes": texts.bytes(t, t_text)}
            for t, lp in _ranked(step)[:k]]
        content.append({"token": text, "logprob": FLOOR if chosen is None else finite(chosen.logprob),
                        "bytes": texts.bytes(token_id, text), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(token_ids: Sequence[int], steps: Sequence[Step] | None, k: int,
                         texts: TokenText) -> list | None:
    """vLLM's ``prompt_logprobs`` shape: per prompt token null or ``{token id: {logprob, rank, decoded_token}}``
    holding that token and the ``k`` most likely."""
    if steps is None:
        return None
    out: list = []
    for i, token_id in enumerate(token_ids):
        step = steps[i] if i < len(steps) else None
        if not step:
            out.append(None)
            continue
        keep = dict(_ranked(step)[:k])
        if token_id in step:
            keep[token_id] = step[token_id]
        out.append({str(t): {"logprob": finite(lp.logprob), "rank": lp.rank, "decoded_token": texts.text(t, lp)}
                    for t, lp in keep.items()})
    return out
