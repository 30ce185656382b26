"""What both dry runs (dry_run.py for DDP, dry_run_sharded.py for FSDP) take their steps
and sizes with."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, cast

import torch

# Bytes per parameter element under each of Lightning's precisions: "-mixed" keeps fp32
# weights (autocast computes in half width), "-true" converts the module.
PARAMETER_DTYPE = {
    "64-true": torch.float64,
    "32-true": torch.float32,
    "bf16-true": torch.bfloat16,
    "16-true": torch.float16,
}


class TrainingStep(torch.nn.Module):
    """DDP wraps a module's forward; the task's loss is its `training_step`."""

    def __init__(self, module: torch.nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, batch: Any) -> torch.Tensor:
        out = cast(Any, self.module).training_step(batch, 0)
        return out["loss"] if isinstance(out, dict) else out


def planned_backend(cfg: Any) -> str:
    """The process group's backend of the planned run, as Lightning would pick it: the
    configured one, else NCCL on GPUs and gloo on CPUs."""
    configured = cfg.strategy.get("process_group_backend")
    if configured:
        return str(configured)
    return "nccl" if str(cfg.accelerator) in ("gpu", "cuda") else "gloo"


def whole_size(tensor: torch.Tensor) -> int:
    """A tensor's bytes; a sharded one's (a DTensor) over all ranks."""
    return tensor.numel() * tensor.element_size()


def tensor_bytes(state: Any, size: Callable[[torch.Tensor], int] = whole_size) -> int:
    """The bytes of every tensor in `state` (an optimizer's state: dicts, lists of them)."""
    if isinstance(state, torch.Tensor):
        return size(state)
    if isinstance(state, dict):
        return sum(tensor_bytes(value, size) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value, size) for value in state)
    return 0


def timed_steps(
    step: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    set_to_none: bool = True,
    before_each: Callable[[], None] = lambda: None,
) -> dict[str, float]:
    """Two real training steps, the first on two samples (the wrapper settles: DDP rebuilds
    its buckets in the order the gradients came), the second on the whole batch; returns
    the second's forward, backward and the rest (the optimizer) in seconds."""
    times: dict[str, float] = {}
    for step_batch in ([part[:2] for part in batch], batch):
        before_each()
        start = time.perf_counter()
        loss = step(step_batch)
        forward = time.perf_counter()
        loss.backward()
        backward = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        times = {
            "forward_s": forward - start,
            "backward_s": backward - forward,
            "rest_s": time.perf_counter() - backward,
        }
    return times
