"""TPRank: what a ModelRunner needs to know to be one rank of a tensor-parallel engine."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

from ..config import ModelConfig
from ..errors import InvalidRequestError
from ..model.sharding import TPShard
from .group import TPGroup

TIMEOUT_ENV = "TIDYRUN_COLLECTIVE_TIMEOUT_S"


def collective_timeout_s(launched: bool) -> float:
    """How long a collective, the rendezvous or a start-up round may wait before it fails instead of hanging.

    Spawned ranks: 300 s (a worker that stops answering is found sooner by its pipe and process). Ranks a
    launcher started: 1800 s, torch's own default for a gloo group, since a trainer's ranks may reach the
    next generate() minutes apart (evaluation, checkpointing). ``TIDYRUN_COLLECTIVE_TIMEOUT_S`` sets both.
    """
    value = os.environ.get(TIMEOUT_ENV)
    if value is None:
        return 1800.0 if launched else 300.0
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise InvalidRequestError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {value!r}")
    return seconds


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

    ``before_connect`` (ranks a launcher started) runs just before the group
    is connected: every rank tells the others it got that far, so a rank
    that failed to allocate its KV cache is named instead of being waited
    for in the rendezvous.
    """

    shard: TPShard
    group: TPGroup
    agree_num_blocks: Callable[[int], int]
    before_connect: Callable[[], None] | None = None
