"""Debugging aids for data-parallel runs: a rank-ordered print, the distributed debug
environment of every worker, and a readable error for parameters that get no gradient.

The callbacks of `debug=` (gradient-sync check, hang watchdog, profiler, host-sync finder)
live in `ddp_template.callbacks`; `conf/debug/` switches them on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig

from ddp_template.errors import TrainingStopped

# Values of TORCH_DISTRIBUTED_DEBUG (c10d's DebugLevel).
DISTRIBUTED_DEBUG_LEVELS = ("OFF", "INFO", "DETAIL")


def debug_print(*values: Any, sep: str = " ") -> None:
    """Prints `values` of every rank on rank 0, in rank order, each line prefixed with its
    rank. A collective: call it on every rank (one rank alone waits for the others, and the
    hang watchdog shows where). Outside a process group it prints like `print`."""
    text = sep.join(str(value) for value in values)
    if not (dist.is_available() and dist.is_initialized()):
        print(f"rank 0 | {text}", flush=True)
        return
    texts: list[str | None] = [None] * dist.get_world_size()
    # The gather is the barrier: every rank has arrived when rank 0 prints.
    dist.all_gather_object(texts, text)
    if dist.get_rank() == 0:
        lines = (f"rank {rank} | {line}" for rank, t in enumerate(texts) for line in t.splitlines())
        print("\n".join(lines), flush=True)


def apply_debug_environment(cfg: DictConfig) -> None:
    """Sets the switches of `debug.*` that PyTorch reads from the environment, before the
    process group starts. Runs in every worker, however it was started (the elastic agent,
    torchrun, srun); torch.distributed read TORCH_DISTRIBUTED_DEBUG at import, so its level
    is set again from the environment."""
    settings = cfg.get("debug") or {}
    level = settings.get("distributed_debug")
    if level is not None:
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = str(level)
        if dist.is_available():
            dist.set_debug_level_from_env()
    entries = settings.get("flight_recorder")
    if entries:
        # Each process group records its last `entries` collectives (gloo and nccl).
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(int(entries))


# DDP's reducer error, and the text Lightning replaces it with.
_NO_GRADIENT_ERRORS = (
    "Expected to have finished reduction in the prior iteration",
    "parameters that were not used in producing the loss",
)


@contextmanager
def explain_unused_parameters(module: torch.nn.Module) -> Iterator[None]:
    """Turns DDP's error about parameters without a gradient into one that names them and
    the switches that fix it."""
    try:
        yield
    except RuntimeError as err:
        if not any(text in str(err) for text in _NO_GRADIENT_ERRORS):
            raise
        raise TrainingStopped(unused_parameters_message(module)) from None


def unused_parameters_message(module: torch.nn.Module) -> str:
    """DDP raises in the forward after the backward that left parameters without a
    gradient; Lightning clears gradients after the forward, so those of the last backward
    are still there: the parameters whose gradient is None got none."""
    unused = [name for name, p in module.named_parameters() if p.requires_grad and p.grad is None]
    listed = ", ".join(unused[:10]) + (f" and {len(unused) - 10} more" if len(unused) > 10 else "")
    which = (
        f"{len(unused)} parameter(s) got no gradient: {listed}"
        if unused
        else ("Some parameters got no gradient")
    )
    return (
        f"{which}. DDP runs with strategy.find_unused_parameters=false, so it waited for "
        "their gradients and cannot start the next step. Fix: strategy.find_unused_parameters="
        "true (DDP then looks for them every step, slightly slower), or "
        "strategy.static_graph=true when the same parameters go unused in every step; or "
        "remove those layers, or freeze them with requires_grad=False"
    )
