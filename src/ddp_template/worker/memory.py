"""Peak memory of this process: what the accelerator allocated, or the host's resident set;
and the bytes of the model's state (parameters, gradients, optimizer state) a rank holds."""

from __future__ import annotations

import contextlib
import ctypes
import gc
import re
import resource
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak, so that runs sharing one process (a sweep's jobs) are each
    measured on their own.

    On the host, what earlier runs freed is first handed back to the system (the C
    allocator keeps freed blocks otherwise, and the resident set would carry them from job
    to job), then the peak (VmHWM) is reset through clear_refs (Linux)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    gc.collect()
    _release_freed_heap()
    # Not Linux, or not permitted: the peak then covers the whole process.
    with contextlib.suppress(OSError):
        _CLEAR_REFS.write_text("5")


def _release_freed_heap() -> None:
    """glibc's malloc_trim(0); nothing elsewhere."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: max bytes allocated by tensors; CPU: peak resident set size of the process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text())
    except OSError:
        match = None
    if match:
        return int(match.group(1)) / 2**10
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def peak_reserved_mb(device: torch.device) -> float | None:
    """CUDA: max bytes the caching allocator held (allocated plus cached); None elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_reserved(device) / 2**20
    return None


def memory_kind(device: torch.device) -> str:
    return "cuda_max_allocated" if device.type == "cuda" else "host_peak_rss"


def local_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes this rank holds of the tensors: a sharded (DTensor) one counts its own shard."""
    from torch.distributed.tensor import DTensor

    total = 0
    for tensor in tensors:
        if tensor is None:
            continue
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        total += local.numel() * local.element_size()
    return total


def model_state_bytes(
    module: torch.nn.Module, optimizers: Iterable[torch.optim.Optimizer]
) -> dict[str, int]:
    """What this rank holds of the parameters, their gradients and the optimizer's state:
    a full copy each under ddp, about 1/W of it under fsdp."""
    parameters = list(module.parameters())
    state = [
        value
        for optimizer in optimizers
        for per_parameter in optimizer.state.values()
        for value in per_parameter.values()
        if isinstance(value, torch.Tensor)
    ]
    return {
        "parameters": local_bytes(parameters),
        "gradients": local_bytes(p.grad for p in parameters),
        "optimizer_state": local_bytes(state),
    }
