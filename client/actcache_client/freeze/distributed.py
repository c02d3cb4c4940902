"""The collectives of the freeze controller: one decision, taken on rank 0, applied by every rank.

Per evaluation every rank calls, in this order and at the same step:
``mean_across_ranks`` (only when the policy needs the loss) then
``broadcast_depth``. DDP is built by ``DdpWrapper`` on every rank at the
same step as well (its constructor is a collective), so every rank must
reach the same evaluation steps: same ``eval_every``, ``step()`` once per
optimizer step.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["DdpWrapper", "broadcast_depth", "mean_across_ranks", "rank_and_world"]

log = logging.getLogger("actcache_client.freeze")


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """(rank, world size) in ``group``; (0, 1) when torch.distributed is not initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _device(group: Any) -> torch.device:
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _src(group: Any) -> int:
    return 0 if group is None else dist.get_global_rank(group, 0)


def mean_across_ranks(value: float | None, group: Any = None) -> float | None:
    """The mean of ``value`` over the ranks that have one (None on every rank if none has)."""
    t = torch.tensor([value if value is not None else 0.0, 1.0 if value is not None else 0.0],
                     dtype=torch.float64, device=_device(group))
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    total, count = t.tolist()
    return total / count if count else None


def broadcast_depth(depth: int | None, group: Any = None) -> int:
    """Rank 0's ``depth`` on every rank (the other ranks pass None)."""
    t = torch.tensor([depth if depth is not None else -1], dtype=torch.int64, device=_device(group))
    dist.broadcast(t, src=_src(group), group=group)
    return int(t.item())


class DdpWrapper:
    """``CachedForward.set_suffix_wrapper`` callback: DDP around the active stages only, timed.

    Frozen stages are outside the wrapped module, so they take no gradient
    buckets and ``find_unused_parameters`` stays off.
    """

    def __init__(self, group: Any = None, **ddp_kwargs: Any) -> None:
        self.group = group
        self.ddp_kwargs = ddp_kwargs
        self.last_seconds: float | None = None
        self.wraps = 0

    def __call__(self, suffix: nn.Module) -> nn.Module:
        start = time.perf_counter()
        wrapped = nn.parallel.DistributedDataParallel(suffix, process_group=self.group, **self.ddp_kwargs)
        self.last_seconds = time.perf_counter() - start
        self.wraps += 1
        log.info("actcache: DDP wrapped %d active stages in %.3f s",
                 len(getattr(suffix, "stages", ())), self.last_seconds)
        return wrapped
