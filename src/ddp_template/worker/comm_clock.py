"""What communication adds to a training step ("exposed communication"), measured the same
way for `ddp` and `fsdp`: the seconds the training thread waits for collectives.

- `fsdp` on CPUs: FSDP2's all-gathers and reduce-scatters complete on the training thread
  (there are no CUDA streams to overlap them on: `tools/scaling.py` `fsdp_overlaps`); each
  is timed through FSDP2's own extension point for its collectives
  (`FSDPModule.set_custom_all_gather`, `set_custom_reduce_scatter`), as PyTorch's default
  ones, with a clock around them. On GPUs they run on streams of their own and the time to
  issue them is not what they cost: not measured there.
- `ddp`: DDP's own timers. Its last bucket's all-reduce ends `backward_comm_time -
  backward_compute_comm_overlap_time` after the backward's compute (averaged over the
  iterations DDP samples: every one of the first ten, then one in a hundred).
"""

from __future__ import annotations

import time
from typing import Any

# Seconds this process's training thread has waited in FSDP's blocking collectives.
_blocked = [0.0]


def blocked_s() -> float:
    return _blocked[0]


class _Clocked:
    """Times each call that completes before it returns (async_op false)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        work = super().__call__(*args, **kwargs)  # type: ignore[misc]
        if not kwargs.get("async_op", False):
            _blocked[0] += time.perf_counter() - start
        return work


def clock_collectives(modules: list[Any]) -> None:
    """FSDP2's default collectives, clocked, on each sharded module (CPUs only). Subclasses
    of the defaults: FSDP2 treats them as its own (its symmetric-memory and process-group
    allocators check for them)."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        DefaultAllGather,
        DefaultReduceScatter,
    )

    gather = type("ClockedAllGather", (_Clocked, DefaultAllGather), {})()
    scatter = type("ClockedReduceScatter", (_Clocked, DefaultReduceScatter), {})()
    for module in modules:
        module.set_custom_all_gather(gather)
        module.set_custom_reduce_scatter(scatter)


def ddp_exposed_s(model: Any) -> float | None:
    """From a DistributedDataParallel wrapper's timers: seconds the all-reduce ran past the
    backward's compute, averaged over DDP's sampled iterations; None before any sample."""
    logged = model._get_ddp_logging_data()
    comm = logged.get("avg_backward_comm_time")
    overlap = logged.get("avg_backward_compute_comm_overlap_time")
    if not comm:
        return None
    return max(0.0, (comm - (overlap or 0)) / 1e9)
