"""Per-request logits processing, applied on the logits' device before sampling, in vLLM's order.

Masks first (``allowed_token_ids``, ``bad_words``, the ``min_tokens`` ban
of stop tokens, a structured-output grammar), then ``logit_bias``, then the
penalties: ``repetition_penalty`` over prompt and output tokens (divide
positive logits, multiply negative ones, as transformers'
RepetitionPenaltyLogitsProcessor and vLLM do), ``frequency_penalty`` per
occurrence and ``presence_penalty`` once, over output tokens only (vLLM's
and OpenAI's formula). Every rule collects its work on the host as index
lists and applies it in a few batched device operations: nothing loops
over the vocabulary in Python.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence as Seq

import torch

from .device_copy import to_device
from .sequence import Sequence
from .structured import PendingMasks, apply_bitmask

_NEG_INF = float("-inf")


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if r:
            out[i, :len(r)] = torch.tensor(r, dtype=torch.int64)
    return out.to(device, non_blocking=True)


def bad_word_bans(seq: Sequence) -> list[int]:
    """Tokens that would complete one of the sequence's bad words after its output so far (vLLM's rule:
    a word's last token is banned when the output ends with the word's other tokens)."""
    words = seq.params.bad_words_token_ids
    if not words:
        return []
    out = seq.output_token_ids
    banned = []
    for ids in words:
        prefix = len(ids) - 1
        if prefix > len(out):
            continue
        if prefix == 0 or out[-prefix:] == ids[:-1]:
            banned.append(ids[-1])
    return banned


def stop_token_bans(seq: Sequence, eos_token_ids: Collection[int]) -> set[int]:
    """The stop tokens a sequence may not sample yet (it is below ``min_tokens``)."""
    if not seq.below_min_tokens():
        return set()
    p = seq.params
    return set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(eos_token_ids))


def apply_penalties(logits: torch.Tensor, rows: list[int], seqs: Seq[Sequence]) -> None:
    """Repetition, frequency and presence penalties of ``seqs`` on logits ``rows``, in place."""
    vocab, dev = logits.shape[-1], logits.device
    index = to_device(rows, dev)
    sub = logits[index]
    outputs = _padded([s.output_token_ids for s in seqs], vocab, dev)
    counts = torch.zeros(len(seqs), vocab + 1, device=dev, dtype=logits.dtype)
    counts.scatter_add_(1, outputs, torch.ones_like(outputs, dtype=logits.dtype))
    counts = counts[:, :vocab]
    rep = to_device([s.params.repetition_penalty for s in seqs], dev, logits.dtype)[:, None]
    if any(s.params.repetition_penalty != 1.0 for s in seqs):
        prompts = _padded([s.prompt_token_ids for s in seqs], vocab, dev)
        seen = torch.zeros(len(seqs), vocab + 1, device=dev, dtype=torch.bool)
        seen.scatter_(1, prompts, True)
        seen = seen[:, :vocab] | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = to_device([s.params.frequency_penalty for s in seqs], dev, logits.dtype)[:, None]
    pres = to_device([s.params.presence_penalty for s in seqs], dev, logits.dtype)[:, None]
    sub = sub - freq * counts - pres * (counts > 0).to(logits.dtype)
    logits[index] = sub


def process_logits(logits: torch.Tensor, seqs: Seq[Sequence], eos_token_ids: Collection[int],
                   masks: PendingMasks | None = None,
                   send_mask: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
    """Apply every sequence's processing to its row of ``logits`` (float32 [len(seqs), vocab]), in place.

    ``masks``: the grammar rows' masks, already being filled on another thread
    (``GrammarCompiler.fill_later``, for exactly the sequences of ``seqs``
    that have a grammar, in order); None computes them here. The rows' other
    rules are collected before waiting for them. ``send_mask``: how the host bitmask reaches the logits'
    device (the runner's pinned staging, ``StepInputs.send_mask``; None: a plain copy).
    """
    dev, vocab = logits.device, logits.shape[-1]
    ban_rows: list[int] = []
    ban_tokens: list[int] = []
    allowed_rows: list[int] = []
    allowed_ids: list[list[int]] = []
    bias_rows: list[int] = []
    bias_tokens: list[int] = []
    bias_values: list[float] = []
    penalty_rows: list[int] = []
    grammar_rows = [row for row, seq in enumerate(seqs) if seq.grammar is not None]
    grammar_states = [seqs[row].grammar for row in grammar_rows]
    if masks is not None and not masks.serve(grammar_states):
        masks.settle()
        raise RuntimeError("process_logits: the pending masks are not those of this batch's grammar rows")
    if grammar_states and masks is None:  # every row's grammar past its last token at once, before any query
        masks = grammar_states[0].compiler.fill_later(grammar_states)  # one engine, one compiler
    deferred: list[tuple[int, set[int]]] = []  # grammar rows whose stop bans depend on the grammar's completeness
    try:
        for row, seq in enumerate(seqs):
            p = seq.params
            banned = stop_token_bans(seq, eos_token_ids)
            if seq.grammar is not None and (banned or p.ignore_eos):  # only then does completeness matter
                deferred.append((row, banned))
                banned = set()
            banned.update(bad_word_bans(seq))
            ban_rows += [row] * len(banned)
            ban_tokens += banned
            if p.allowed_token_ids is not None:
                allowed_rows.append(row)
                allowed_ids.append(p.allowed_token_ids)
            if p.logit_bias:
                bias_rows += [row] * len(p.logit_bias)
                bias_tokens += p.logit_bias.keys()
                bias_values += p.logit_bias.values()
            if p.has_penalties:
                penalty_rows.append(row)
    except BaseException:
        if masks is not None:
            masks.settle()  # the states go back to this thread before the error leaves
        raise
    bitmask = masks.wait() if masks is not None else None  # from here the states are this thread's again
    for row, banned in deferred:
        if seqs[row].grammar.is_terminated:  # a complete grammar allows only EOS: it wins over min_tokens
            continue
        if seqs[row].params.ignore_eos:
            banned.update(eos_token_ids)  # EOS would end a structured sequence: ignore_eos keeps it going
        ban_rows += [row] * len(banned)
        ban_tokens += banned
    if allowed_rows:
        keep = torch.zeros(len(allowed_rows), vocab, dtype=torch.bool)
        for i, ids in enumerate(allowed_ids):
            keep[i, ids] = True
        index = to_device(allowed_rows, dev)
        logits[index] = logits[index].masked_fill(~keep.to(dev, non_blocking=True), _NEG_INF)
    if ban_rows:
        # index_put_ with a value already on the device: ``logits[r, t] = -inf`` wraps the float in a CPU tensor
        # that torch (<= 2.13) copies over with a stream synchronize (device_copy.py says why that matters).
        logits.index_put_((to_device(ban_rows, dev), to_device(ban_tokens, dev)), logits.new_full((), _NEG_INF))
    if bitmask is not None:
        if send_mask is not None:
            bitmask = send_mask(bitmask)
        apply_bitmask(logits, bitmask, None if len(grammar_rows) == len(seqs) else grammar_rows)  # None: no gather
    if bias_rows:
        logits.index_put_((to_device(bias_rows, dev), to_device(bias_tokens, dev)),
                          to_device(bias_values, dev, logits.dtype), accumulate=True)
    if penalty_rows:
        apply_penalties(logits, penalty_rows, [seqs[r] for r in penalty_rows])
