"""Peak memory of this process: what the accelerator allocated, or the host's resident set."""

from __future__ import annotations

import resource
import sys

import torch


def peak_memory_mb(device: torch.device) -> float:
    """CUDA: max bytes allocated by tensors; CPU: peak resident set size of the process."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


def memory_kind(device: torch.device) -> str:
    return "cuda_max_allocated" if device.type == "cuda" else "host_peak_rss"
