"""TPRank: what a ModelRunner needs to know to be one rank of a tensor-parallel engine."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import InvalidRequestError
from ..model.sharding import TPShard
from .group import TPGroup

# A collective, a rendezvous or the start-up agreement that waits longer fails instead of hanging.
COLLECTIVE_TIMEOUT_S = 300.0


def check_rank_count(world: int, cfg: ModelConfig) -> None:
    """Refuse a tensor_parallel_size the model cannot be split over, before any rank loads anything."""
    if world > cfg.num_kv_heads:
        raise InvalidRequestError(
            f"tensor_parallel_size={world} exceeds the model's {cfg.num_kv_heads} KV heads: every rank needs "
            f"at least one whole KV head")


@dataclass(frozen=True)
class TPRank:
    """This rank's slice, its group, and how the ranks agree on a KV block count.

    Every rank sizes its own KV cache (each holds different heads, and on
    CUDA each has its own free memory); ``agree_num_blocks`` takes this rank's
    count and returns the one all ranks use (the smallest), since a block id
    must mean the same slots everywhere. It runs once every rank has loaded
    its weights, before the group is connected (over the driver's pipes, or
    the launcher's store), so a rank that failed to start is reported by
    name instead of timing a collective out.
    """

    shard: TPShard
    group: TPGroup
    agree_num_blocks: Callable[[int], int]
