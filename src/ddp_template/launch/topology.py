"""How a run is laid out on the machine: cores, processes and batches, each computed here
once and asked for everywhere else (the worker threads, the loader workers, the start-up
table, the run summary, results.json)."""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_cores() -> int:
    """The cores this process may use: its affinity mask (SLURM, taskset), lowered to its
    cgroup's cpu quota rounded up (a container's CPU limit under Kubernetes or Docker, a
    node's share on the lab). Without the quota, a pod limited to 4 CPUs on a 64-core host
    would start 64 threads per rank, and the kernel would stop them all, for the rest of
    each 100 ms period, once their 4 CPUs' worth is spent."""
    if hasattr(os, "sched_getaffinity"):
        cores = len(os.sched_getaffinity(0))
    else:
        cores = os.cpu_count() or 1
    quota = cpu_quota_cores()
    return max(1, min(cores, math.ceil(quota))) if quota else cores


def cpu_quota_cores(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT
) -> float | None:
    """The tightest cpu quota on this process's cgroup or an ancestor, in cores (e.g. 0.4),
    or None: no quota, or no cgroup file system to read (cgroup v2's `cpu.max`, v1's
    `cpu.cfs_quota_us` / `cpu.cfs_period_us`)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        if controllers == "":  # cgroup v2: one tree, cpu.max
            quotas += _quotas_up_to_root(root, path)
        elif "cpu" in controllers.split(","):  # cgroup v1: the cpu controller's own tree
            # Mounted under its controllers' names, or at cpu (a link on some machines).
            mounts = [root / controllers, root / "cpu"]
            mount = next((m for m in mounts if m.is_dir()), None)
            if mount is not None:
                quotas += _quotas_up_to_root(mount, path)
    return min(quotas) if quotas else None


def _quotas_up_to_root(mount: Path, path: str) -> list[float]:
    """The quotas (cores) of cgroup `path` and its ancestors under the hierarchy at `mount`;
    a container's own namespace shows its cgroup as "/" (the mount is then that cgroup)."""
    quotas = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        folder = mount.joinpath(*parts[:depth])
        try:
            if (folder / "cpu.max").is_file():
                limit, period = (folder / "cpu.max").read_text().split()
                if limit != "max":
                    quotas.append(int(limit) / int(period))
            elif (folder / "cpu.cfs_quota_us").is_file():
                quota_us = int((folder / "cpu.cfs_quota_us").read_text())
                if quota_us > 0:
                    quotas.append(quota_us / int((folder / "cpu.cfs_period_us").read_text()))
        except (OSError, ValueError):
            continue
    return quotas


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
