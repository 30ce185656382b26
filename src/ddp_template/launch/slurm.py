"""`launcher=slurm`: what the cluster offers, asked with `sinfo` in the launching process.

The launcher's resources follow the cluster (GPUs only for a GPU run, CPUs per task that fit
a node), and a sweep is checked against the partition before anything is queued: a
partition that does not exist, or more tasks per node than a node has CPUs, would otherwise
fail inside sbatch with a traceback, or wait in the queue forever.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from ddp_template.errors import ConfigError
from ddp_template.launch.cuda_devices import on_cuda

# More CPUs per task than this rarely helps one training process (data loading workers).
MAX_CPUS_PER_TASK = 8
# Keys that set the resources of every job of a sweep at once: SLURM's task count and
# nodes are read once, from the sweep's config, so they cannot differ between its jobs.
SWEEP_WIDE_KEYS = ("devices", "num_nodes", "accelerator")

# Lightning warns on every run of a machine where srun is installed that the run was not
# started with srun (also for srun's tasks inside an interactive allocation, which it does
# not take for SLURM's); here a plain run starts its own workers on purpose, SLURM runs go
# through launcher=slurm (or srun), and srun's tasks are ranks of one job in an interactive
# allocation too (starters.SRUN).
warnings.filterwarnings("ignore", message=".*The `srun` command is available on your system")


@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    cpus: int


def nodes() -> list[Node] | None:
    """The cluster's nodes (`sinfo`), or None without SLURM's commands here."""
    if shutil.which("sinfo") is None:
        return None
    out = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--format=%N|%P|%c"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        return None
    found: dict[str, Node] = {}
    for line in out.stdout.splitlines():
        name, partition, cpus = line.strip().split("|")
        previous = found.get(name)
        partitions = (previous.partitions if previous else ()) + (partition,)
        found[name] = Node(name, partitions, int(cpus))
    return list(found.values())


def partition_nodes(all_nodes: list[Node], partition: str | None) -> list[Node]:
    """Nodes of `partition` (None: the default partition, marked `*` by sinfo)."""
    if partition is None:
        return [n for n in all_nodes if any(p.endswith("*") for p in n.partitions)]
    return [n for n in all_nodes if partition in (p.rstrip("*") for p in n.partitions)]


def gpus_per_node(accelerator: str, devices: Any) -> int | None:
    """`${slurm_gpus:...}`: one GPU per task for a GPU run; none asked on CPUs (a CPU
    partition refuses any GPU request: `Invalid generic resource`)."""
    return int(devices) if on_cuda(str(accelerator)) and str(devices).isdigit() else None


def cpus_per_task(devices: Any, partition: str | None = None) -> int:
    """`${slurm_cpus_per_task:...}`: an equal share of the smallest node's CPUs for each of
    its `devices` tasks, at most MAX_CPUS_PER_TASK; 1 when the cluster cannot be asked."""
    found = nodes()
    members = partition_nodes(found, partition) if found else []
    if not members or not str(devices).isdigit():
        return 1
    smallest = min(n.cpus for n in members)
    return max(1, min(MAX_CPUS_PER_TASK, smallest // max(1, int(devices))))


def check_submission(cfg: DictConfig) -> None:
    """Raises ConfigError when the sweep cannot run on the cluster."""
    _check_sweep_wide_keys(cfg)
    found = nodes()
    if found is None:
        raise ConfigError(
            "launcher",
            "slurm",
            "a machine with SLURM's commands (sinfo, sbatch); none found here",
            "run on the cluster's login node, or start a local cluster: "
            "bash scripts/slurm_local.sh start",
        )
    launcher = cfg.hydra.launcher
    partition = launcher.partition
    members = partition_nodes(found, partition)
    if not members:
        names = sorted({p.rstrip("*") for n in found for p in n.partitions})
        raise ConfigError(
            "hydra.launcher.partition",
            partition,
            f"a partition of this cluster: {', '.join(names)} (sinfo)",
            f"e.g. hydra.launcher.partition={names[0]}" if names else "ask your admin",
        )
    where = f"partition {partition}" if partition else "the default partition"
    if int(launcher.nodes) > len(members):
        raise ConfigError(
            "num_nodes",
            cfg.num_nodes,
            f"at most the {len(members)} nodes of {where}",
            "lower num_nodes, or pick a larger partition",
        )
    _check_node_list(launcher, members, where)
    largest = max(n.cpus for n in members)
    tasks = int(launcher.tasks_per_node)
    if tasks > largest:
        raise ConfigError(
            "devices",
            cfg.devices,
            f"at most {largest} with launcher=slurm on {where}: one task per device, each "
            f"needs a CPU, and its largest node has {largest} CPUs (sinfo)",
            f"devices={largest} or fewer, or more nodes (num_nodes) or another partition",
        )
    cpus = launcher.cpus_per_task
    if cpus is not None and tasks * int(cpus) > largest:
        raise ConfigError(
            "hydra.launcher.cpus_per_task",
            cpus,
            f"at most {largest // tasks} for {tasks} tasks per node: the largest node of "
            f"{where} has {largest} CPUs (sinfo)",
            f"hydra.launcher.cpus_per_task={largest // tasks}",
        )


def _check_node_list(launcher: DictConfig, members: list[Node], where: str) -> None:
    """`hydra.launcher.additional_parameters.nodelist` (sbatch's --nodelist) names nodes of
    the partition: sbatch would refuse an unknown one (`Invalid node name specified`) with
    submitit's traceback around it."""
    requested = (launcher.get("additional_parameters") or {}).get("nodelist")
    if not requested:
        return
    key = "hydra.launcher.additional_parameters.nodelist"
    known = sorted(n.name for n in members)
    fix = f"name nodes that sinfo lists in {where} (e.g. {key}={known[0]}), or leave {key} out"
    expanded = subprocess.run(
        ["scontrol", "show", "hostnames", str(requested)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if expanded.returncode != 0:
        raise ConfigError(key, requested, f"a SLURM host list: {expanded.stderr.strip()}", fix)
    unknown = [name for name in expanded.stdout.split() if name not in known]
    if unknown:
        raise ConfigError(
            key,
            requested,
            f"nodes of {where}: {', '.join(known)} (sinfo); it has no {', '.join(unknown)}",
            fix,
        )


def _check_sweep_wide_keys(cfg: DictConfig) -> None:
    parsed = OverridesParser.create().parse_overrides(list(cfg.hydra.overrides.task))
    for override in parsed:
        if override.get_key_element() in SWEEP_WIDE_KEYS and override.is_sweep_override():
            raise ConfigError(
                override.get_key_element(),
                override.value(),
                "one value per sweep with launcher=slurm: every job of a sweep gets the same "
                "SLURM resources (tasks per node, nodes, GPUs)",
                "start one sweep per value",
            )


class CheckSubmission(Callback):
    """Hydra callback of `launcher=slurm`: checks the sweep before anything is queued."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_submission(config)
        except ConfigError as err:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
