"""Which slice of the model one tensor-parallel rank holds.

Attention is split by KV head (each rank gets whole KV heads and the query
heads that share them), the MLP by intermediate channel (every expert of a
mixture by its own intermediate channels; routers are replicated) and the embedding /
LM head by vocabulary row. Splits need not be even: SmolLM2's 3 KV heads over
2 ranks are 2 + 1. The first ``n % world`` ranks take one more, so rank 0,
the driver, always holds the largest slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import ModelConfig


def split_range(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s part when ``n`` items are split over ``world`` ranks as evenly as possible."""
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (rank < extra)


@dataclass(frozen=True)
class TPShard:
    """One rank's slices, each a (start, length) range of a split dimension.

    ``world == 1`` is the unsplit model: every range is the whole dimension.
    """

    rank: int
    world: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]
    expert_intermediate: tuple[int, int] = (0, 0)

    @classmethod
    def of(cls, cfg: ModelConfig, rank: int = 0, world: int = 1) -> TPShard:
        group = cfg.num_heads // cfg.num_kv_heads
        kv_start, kv_len = split_range(cfg.num_kv_heads, world, rank)
        return cls(rank, world, (kv_start, kv_len), (kv_start * group, kv_len * group),
                   split_range(cfg.intermediate_size, world, rank), split_range(cfg.vocab_size, world, rank),
                   split_range(cfg.moe_intermediate_size, world, rank))

    @property
    def num_kv_heads(self) -> int:
        return self.kv_heads[1]

    @property
    def num_heads(self) -> int:
        return self.heads[1]

    @property
    def intermediate_size(self) -> int:
        return self.intermediate[1]

    @property
    def vocab_size(self) -> int:
        return self.vocab[1]
