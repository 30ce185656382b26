"""CUDA devices as the launching process may see them: without a CUDA context, and knowing
whether a process forked from it can still use CUDA.

torch counts GPUs through NVML where it can (`PYTORCH_NVML_BASED_CUDA_CHECK=1`, set by
`train.py`; Lightning counts the same way): no CUDA call is made, and a process forked
afterwards initialises CUDA normally. Where NVML cannot count (no NVML library in the
container; MIG instances in `CUDA_VISIBLE_DEVICES`, for which torch skips NVML),
`torch.cuda.device_count()` asks the CUDA runtime instead (`cudaGetDeviceCount`). That
call registers torch's fork handler: every process forked afterwards is in a "bad fork"
(`torch.cuda._is_in_bad_fork()`) and fails at its first CUDA call with "Cannot
re-initialize CUDA in forked subprocess", while `torch.cuda.is_initialized()` stays False
in the parent. torch offers no way to read that state in the parent, so
`forked_child_can_use_cuda` forks a child that reports it and exits at once.

Compute capabilities come from NVML for the same reason (`torch.cuda.get_device_capability`
creates a context); where NVML cannot tell, the worker checks with torch.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Mapping

VISIBLE = "CUDA_VISIBLE_DEVICES"


def visible_devices(env: Mapping[str, str] = os.environ) -> list[str] | None:
    """The devices `CUDA_VISIBLE_DEVICES` lists (None where it is unset: every GPU), read
    as CUDA reads it: up to the first empty or invalid entry."""
    value = env.get(VISIBLE)
    if value is None:
        return None
    names = []
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        names.append(entry)
    return names


def lists_mig(env: Mapping[str, str] = os.environ) -> bool:
    """Whether `CUDA_VISIBLE_DEVICES` names MIG instances (a process sees the first one)."""
    return any(name.startswith("MIG-") for name in visible_devices(env) or [])


def forked_child_can_use_cuda() -> bool:
    """Whether a process forked from this one now can initialise CUDA (False once this
    process initialised CUDA, or counted its devices through the CUDA runtime)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda._is_compiled():
        return True
    if torch.cuda.is_initialized():
        return False
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave, running nothing of the parent's
        os.write(write, b"1" if torch.cuda._is_in_bad_fork() else b"0")
        os._exit(0)
    os.close(write)
    try:
        answer = os.read(read, 1)
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    return answer == b"0"


def threads_a_fork_would_lose() -> int:
    """Threads of this process besides the calling one, as the kernel counts them (Python's
    and native ones: a TCPStore's server, an uploader's C++ pool, which `threading` does
    not list), less OpenBLAS's server threads: OpenBLAS starts N-1 of them when it loads
    (numpy and scipy each bring one OpenBLAS) and rebuilds its pool in a forked child. Only
    native threads can be OpenBLAS's: in a process itself forked from one that loaded
    OpenBLAS, its pool is not running, and a Python thread is not to be taken for it."""
    import threading

    try:
        threads = len(os.listdir("/proc/self/task"))
    except OSError:
        threads = threading.active_count()
    from threadpoolctl import threadpool_info

    pools = sum(
        max(0, int(info["num_threads"]) - 1)
        for info in threadpool_info()
        if info.get("internal_api") == "openblas" and info.get("threading_layer") == "pthreads"
    )
    python_threads = min(threads, threading.active_count())
    native = threads - python_threads
    return python_threads - 1 + max(0, native - pools)


def compute_capabilities() -> list[tuple[int, int]] | None:
    """(major, minor) of every visible GPU, asked of NVML (no CUDA context); None where
    NVML cannot tell (no NVML library, MIG instances or UUIDs in CUDA_VISIBLE_DEVICES)."""
    names = visible_devices()
    if names is not None and not all(name.isdigit() for name in names):
        return None
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        indices = [int(name) for name in names] if names is not None else range(count.value)
        capabilities = []
        for index in indices:
            if index >= count.value:
                break
            handle = ctypes.c_void_p()
            major, minor = ctypes.c_int(0), ctypes.c_int(0)
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                return None
            if nvml.nvmlDeviceGetCudaComputeCapability(
                handle, ctypes.byref(major), ctypes.byref(minor)
            ):
                return None
            capabilities.append((major.value, minor.value))
        return capabilities
    finally:
        nvml.nvmlShutdown()


def on_cuda(accelerator: str) -> bool:
    """Whether the run trains on CUDA devices (`auto` counts when a GPU is visible)."""
    if accelerator in ("cuda", "gpu"):
        return True
    if accelerator == "auto":
        import torch

        return torch.cuda.is_available()
    return False
