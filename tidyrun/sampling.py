"""The sampler: turns a batch of (processed) logits into tokens. ``SamplingParams`` lives in sampling_params.py."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from .device_copy import to_device
from .sampling_params import SamplingParams


_INT63 = 2**63 - 1  # a generator's seed as an int64 key (the engine's seeds are below 2**63)

RaceFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, "torch.Tensor | None"]]


class RaceDraw(NamedTuple):
    """The racing rows of a batch (indices), their noise (float32 [R, vocab] Exp(1) draws, or int64 [R, 2] keys
    a keyed race draws them from) and scale (``Sampler.race_noise``); None without rows."""
    rows: list[int]
    noise: torch.Tensor | None
    scale: torch.Tensor | None


class Sampler:
    """Turns a batch of logits into one token per row.

    Greedy rows are an exact argmax. Other rows are scaled by temperature,
    filtered by min-p (against the most likely token), then top-k, then top-p
    (on the distribution the previous filters left), vLLM's order, and sampled with the row's own
    ``torch.Generator`` so a seeded request draws the same tokens whatever
    else is in the batch. A row with no filter (the RL rollout default:
    top_k, top_p, min_p all off) skips the sort of the vocabulary: it takes
    the exponential race, ``race`` (the runner's ops: one Triton pass on
    CUDA, ``race_sample`` elsewhere), which also gives its log-probability.
    With ``keyed`` (the Triton race), a racing row's noise is not drawn from
    its generator: the kernel draws it from the row's key, its generator's
    seed and ``steps[i]`` (the output index of the token it samples), one
    small copy for the batch instead of a launch per row (see
    ``race_noise``); a row's draws still depend only on its own seed and
    position. Holds no device memory between calls.
    """

    def __init__(self, race: RaceFn | None = None, keyed: bool = False) -> None:
        self.race = race or race_sample
        self.keyed = keyed

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None], race: RaceDraw | None = None,
                 steps: Sequence[int] | None = None) -> torch.Tensor:
        """One token per row. ``race``: the racing rows' noise from ``draw_race`` on these params, generators
        and steps, drawn earlier (None: drawn here)."""
        tokens = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return tokens
        vocab, dev = logits.shape[-1], logits.device
        race = race or self.draw_race(logits, params, generators, steps)
        if race.rows:
            if len(race.rows) == len(params):
                return self.race(logits, race.noise, race.scale, False)[0]
            index = to_device(race.rows, dev)
            tokens[index] = self.race(logits[index], race.noise, race.scale, False)[0]
        filtered = [i for i, p in enumerate(params) if not p.greedy and not unfiltered(p, vocab)]
        if filtered:
            index = to_device(filtered, dev)
            probs, order = self._sorted_filtered(logits[index].float(), [params[i] for i in filtered])
            picks = torch.stack([draw(probs[j], generators[i]) for j, i in enumerate(filtered)])
            tokens[index] = order[torch.arange(len(filtered), device=dev), picks]
        return tokens

    def draw_race(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                  generators: Sequence[torch.Generator | None], steps: Sequence[int] | None = None) -> RaceDraw:
        """The noise of the rows that race (sampled, ``unfiltered``), drawn now: the same draws ``__call__``
        makes. Only the logits' shape and device matter, so a caller whose logits are not final yet (a
        grammar mask still being filled on another thread) draws it first: on the H200 host, 64 rows drawn
        from their generators take ~1 ms of kernel launches, which then overlap the mask's fill."""
        vocab = logits.shape[-1]
        rows = [i for i, p in enumerate(params) if not p.greedy and unfiltered(p, vocab)]
        if not rows:
            return RaceDraw(rows, None, None)
        noise, scale = self.race_noise((len(rows), vocab), logits.device, [params[i] for i in rows],
                                       [generators[i] for i in rows], None if steps is None else [steps[i] for i in rows])
        return RaceDraw(rows, noise, scale)

    def race_noise(self, shape: tuple[int, int], dev: torch.device, params: Sequence[SamplingParams],
                   generators: Sequence[torch.Generator | None],
                   steps: Sequence[int] | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The race's noise and scale for the rows ``params`` (``race_inputs``'s). Keyed, when every sampled
        row has its generator (the engine gives each one), the noise is int64 [B, 2] keys (the generator's
        seed, ``steps[i]``) instead: one small copy, not one ``exponential_`` launch per row; ``steps`` is then
        required (a row keyed by the wrong step would repeat its draws)."""
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if not self.keyed or not sampled or any(generators[i] is None for i in sampled):
            return race_inputs(shape, dev, params, generators)
        if steps is None or len(steps) != len(params):
            raise ValueError("a keyed race needs each row's step (the output index of the token it samples)")
        keys = torch.tensor([[0 if g is None else g.initial_seed() & _INT63, n] for g, n in zip(generators, steps)],
                            dtype=torch.int64)
        return keys.to(dev, non_blocking=True), race_scale(params, dev)

    def race_packed(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                    generators: Sequence[torch.Generator | None],
                    steps: Sequence[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """For rows that are all greedy or ``unfiltered`` (the caller's to check, once per sequence: a
        filtered row would be sampled from its whole distribution): one race over the batch, on the device:
        the tokens (int64) and float64 rows (token, raw log-probability, rank). The tokens are those
        ``__call__`` draws from the same generators and steps."""
        return self.race(logits, *self.race_noise(logits.shape, logits.device, params, generators, steps), True)

    def probabilities(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The distribution [rows, vocab] each (non-greedy) row samples from, after all filters."""
        probs, order = self._sorted_filtered(logits, params)
        return torch.zeros_like(probs).scatter_(-1, order, probs)

    def filtered_logits(self, logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
        """The temperature-scaled logits [rows, vocab] each (non-greedy) row samples from: -inf where top-k,
        top-p or min-p removed a token. Their softmax is ``probabilities``; unlike the probabilities, they
        keep every surviving token's value however unlikely (no underflow to 0)."""
        probs, order, scaled = self._sorted_filtered(logits, params, keep_logits=True)
        return torch.full_like(scaled, float("-inf")).scatter_(-1, order, scaled)

    @staticmethod
    def _sorted_filtered(sub: torch.Tensor, params: Sequence[SamplingParams], keep_logits: bool = False):
        dev = sub.device
        temps = to_device([p.temperature for p in params], dev, sub.dtype)
        sorted_logits, order = (sub / temps[:, None]).sort(dim=-1, descending=True)
        # min-p first, on the whole tempered distribution, then top-k, then top-p on what is left: vLLM's order.
        min_p = to_device([p.min_p for p in params], dev, sub.dtype)
        probs = sorted_logits.softmax(dim=-1)
        sorted_logits = sorted_logits.masked_fill(probs < min_p[:, None] * probs[:, :1], float("-inf"))
        rank = torch.arange(sorted_logits.shape[-1], device=dev)[None, :]
        top_k = to_device([p.top_k if p.top_k > 0 else sub.shape[-1] for p in params], dev)
        sorted_logits = sorted_logits.masked_fill(rank >= top_k[:, None], float("-inf"))
        top_p = to_device([p.top_p for p in params], dev, sub.dtype)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the mass before it already reaches top_p (the first token always stays). Rows with
        # top_p = 1 keep everything: their cumulative sum can round to 1 before the tail.
        drop = (probs.cumsum(dim=-1) - probs >= top_p[:, None]) & (top_p[:, None] < 1.0)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        if keep_logits:
            return sorted_logits.softmax(dim=-1), order, sorted_logits
        return sorted_logits.softmax(dim=-1), order


def unfiltered(params: SamplingParams, vocab: int | None = None) -> bool:
    """Whether a sampled row keeps its whole distribution (no top-k, top-p or min-p cut): it can race.
    Without ``vocab`` a top-k counts as a cut whatever its size."""
    return ((params.top_k <= 0 or (vocab is not None and params.top_k >= vocab))
            and params.top_p >= 1.0 and params.min_p <= 0.0)


def race_inputs(shape: tuple[int, int], dev: torch.device, params: Sequence[SamplingParams],
                generators: Sequence[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """The race's noise (float32 ``shape`` [B, vocab] on ``dev``, Exp(1) from each sampled row's generator;
    greedy rows' rows are left unset) and scale (float32 [B, 2]: 1 / temperature and 1 for sampled rows, 1 and
    0 for greedy)."""
    noise = torch.empty(shape, dtype=torch.float32, device=dev)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled and all(generators[i] is None for i in sampled):
        noise.exponential_()  # one draw from the global generator for the whole batch
    else:
        for i in sampled:
            noise[i].exponential_(generator=generators[i])
    return noise, race_scale(params, dev)


def race_scale(params: Sequence[SamplingParams], dev: torch.device) -> torch.Tensor:
    """The race's scale (float32 [B, 2] on ``dev``): 1 / temperature and 1 for sampled rows, 1 and 0 for greedy."""
    scale = torch.tensor([[1.0, 0.0] if p.greedy else [1.0 / p.temperature, 1.0] for p in params],
                         dtype=torch.float32)
    return scale.to(dev, non_blocking=True)


def race_sample(logits: torch.Tensor, noise: torch.Tensor, scale: torch.Tensor,
                want_logprob: bool, bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Tokens by the exponential race: argmax(logits * scale[:, 0] - log(noise)) per row, the noise only
    where scale[:, 1] is set (else the plain argmax), which samples softmax(logits / T) exactly; with a
    ``bitmask`` (a grammar's int32 words on the logits' device, ``allowed_tokens``) among its allowed tokens
    only, which samples the masked distribution. With ``want_logprob`` also float64 [B, 3] rows of (token,
    log-probability under softmax(logits), 1-based rank): the raw log-probability, before temperature and
    mask, as vLLM's "raw_logprobs". The reference of the Triton kernels in ``tidyrun.kernels.race``."""
    if noise.dtype == torch.int64:
        raise ValueError("the torch race takes drawn noise, not keys (only the Triton race draws from keys)")
    x = logits.float()
    gumbel = torch.where(scale[:, 1:] != 0, noise.clamp_min(1e-30).log(), 0.0)
    race = x * scale[:, :1] - gumbel
    if bitmask is not None:
        race = race.masked_fill(~allowed_tokens(bitmask, x.shape[1]), float("-inf"))
    tokens = race.argmax(dim=-1)
    if not want_logprob:
        return tokens, None
    value = x.gather(1, tokens[:, None])[:, 0]
    rank = (x > value[:, None]).sum(-1) + 1
    return tokens, torch.stack([tokens.double(), (value - x.logsumexp(-1)).double(), rank.double()], dim=1)


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """A bool [rows, vocab] from int32 words [rows, ceil(vocab / 32)] (bit ``t % 32`` of word ``t // 32`` set:
    token t allowed, llguidance's layout), on the words' device, without a loop over tokens: the words are
    read as little-endian bytes (as on every platform torch and llguidance run on)."""
    rows, dev = bitmask.shape[0], bitmask.device
    packed = bitmask.contiguous().view(torch.uint8)  # [rows, words * 4]: byte k holds tokens 8k..8k+7
    bits = torch.ones(8, dtype=torch.uint8, device=dev) << torch.arange(8, dtype=torch.uint8, device=dev)
    return ((packed.unsqueeze(-1) & bits) != 0).view(rows, -1)[:, :vocab]


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """One index drawn from ``probs`` (1-D) with ``generator``: the exponential race argmax(p / E), E ~ Exp(1)."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / noise).argmax()


def logprob_records(scores: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int],
                    shift: torch.Tensor | None = None) -> list[tuple[int, float, int, tuple[int, ...], tuple[float, ...]]]:
    """Per row: (token, its score, its 1-based rank, the top-k ids, their scores), k = ``ks[row]``.

    ``scores`` [rows, vocab] are log-probabilities or logits; ``shift`` (a row's
    logsumexp) turns logits into log-probabilities without materialising
    ``log_softmax`` over the vocabulary (ranks and top-k do not change).
    Everything is computed on the scores' device and comes to the host in
    one copy, whatever the number of rows.
    """
    return unpack_records(pack_records(scores, tokens, ks, shift).tolist(), ks)


def unpack_records(packed: list[list[float]], ks: Sequence[int]) -> list[tuple[int, float, int, tuple[int, ...],
                                                                              tuple[float, ...]]]:
    """``pack_records``' rows, on the host, as ``logprob_records`` returns them."""
    k = max(ks)
    return [(int(row[0]), row[1], int(row[2]), tuple(int(t) for t in row[3:3 + n]), tuple(row[3 + k:3 + k + n]))
            for row, n in zip(packed, ks)]


def pack_records(scores: torch.Tensor, tokens: torch.Tensor, ks: Sequence[int],
                 shift: torch.Tensor | None = None) -> torch.Tensor:
    """``logprob_records``' rows before they leave the device: float64 [rows, 3 + 2 * max(ks)], each row
    (token, score, rank, top-k ids, top-k scores); with every k 0 the (token, logprob, rank) rows an async
    step copies to the host with its tokens."""
    value = scores.gather(1, tokens[:, None])[:, 0]
    rank = (scores > value[:, None]).sum(-1)
    k = max(ks)
    top_values, top_ids = scores.topk(k, dim=-1) if k else (scores[:, :0], tokens[:, None][:, :0])
    if shift is not None:
        value, top_values = value - shift, top_values - shift[:, None]
    # float64 holds every token id and rank exactly (< 2**53): one tensor, one copy to the host.
    return torch.cat([tokens[:, None].double(), value[:, None].double(), rank[:, None].double() + 1,
                      top_ids.double(), top_values.double()], dim=1)
