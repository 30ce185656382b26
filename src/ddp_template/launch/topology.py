"""How a run is laid out on the machine: cores, processes and batches, each computed here
once and asked for everywhere else (the worker threads, the loader workers, the start-up
table, the run summary, results.json)."""

from __future__ import annotations

import os


def available_cores() -> int:
    """The cores this process may run on (its affinity mask under SLURM or taskset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cores_per_process(local_processes: int) -> int:
    """A node's cores shared evenly by the training processes on it, at least one each."""
    return max(1, available_cores() // max(1, local_processes))


def global_batch_size(per_device: int, world_size: int, accumulation: int) -> int:
    """Samples behind one optimizer step: every rank's batch, over the accumulated steps."""
    return per_device * world_size * accumulation


def global_batch_text(per_device: int, world_size: int, accumulation: int) -> str:
    total = global_batch_size(per_device, world_size, accumulation)
    return f"{total} (= {per_device} x {world_size} ranks x {accumulation} accumulation)"


def workers_per_rank(processes_per_node: object, minimum: int = 1) -> int:
    """DataLoader workers for one rank: the cores it may use, less the one it trains on
    (`${workers_per_rank:${devices},0}` allows none when a rank has a single core)."""
    processes = processes_per_node if isinstance(processes_per_node, int) else 1
    return max(minimum, cores_per_process(processes) - 1)
