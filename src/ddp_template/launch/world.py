"""The processes of a job: how many per node, on how many nodes, and who restarts them.

An external starter (torchrun, srun, a Kubeflow PyTorchJob, Open MPI's mpirun, LSF's
jsrun: one entry each in `starters`) starts every process of a job itself; each runs
`train.py` as one rank (docs/nodes.md has a row per starter). `devices` (processes per
node) and `num_nodes` are then facts about what was started, read from the starter's
environment: `auto` (the default) takes them, and a number that disagrees stops every
process before training. Starters whose processes cannot be ranked from their environment
(MPICH's or Intel MPI's mpiexec; mpirun on several nodes without MASTER_ADDR) are refused
in every process, before training, rather than left to train one independent job per
process. Without a starter, `devices=auto` is every visible GPU (1 on the CPU) and
`num_nodes=auto` is 1.
"""

from __future__ import annotations

import numbers

from ddp_template.errors import ConfigError
from ddp_template.launch.starters import LaunchedWorld, current, started_by

AUTO = "auto"

__all__ = ["AUTO", "LaunchedWorld", "check_restarts", "launched_world", "started_by"]


def launched_world(devices: object = AUTO) -> LaunchedWorld | None:
    """The processes per node and nodes the external starter started (None without one);
    `devices` is the value named when the starter's numbers cannot be used. Raises
    UserFacingError for a starter whose processes cannot be one job."""
    starter = current()
    return starter.world(devices) if starter else None


def take_launched_world(devices: object, num_nodes: object) -> tuple[object, object]:
    """`devices` and `num_nodes` as the launcher started them: `auto` takes the launcher's
    number, a number that disagrees is refused. Without a launcher, `num_nodes=auto` is 1
    and `devices` is left to the accelerator's count."""
    world = launched_world(devices)
    if world is None:
        return devices, 1 if num_nodes == AUTO else num_nodes
    return (
        _agree("devices", devices, world.processes_per_node, world.processes_flag, world),
        _agree("num_nodes", num_nodes, world.nodes, world.nodes_flag, world),
    )


def check_restarts(max_restarts: int, strategy: str, devices: int) -> None:
    """`max_restarts` works only where this project's elastic agent starts the workers;
    elsewhere something else restarts them, or nothing does."""
    if max_restarts == 0:
        return
    starter = current()
    if starter is not None and starter.restarts is not None:
        allowed, fix = starter.restarts
        fix = fix.format(max_restarts=max_restarts)
    elif starter is not None:
        allowed = f"0 under {starter.name}: {starter.name} started the processes, and restarts none"
        fix = (
            f"drop max_restarts; start the job with torchrun --max-restarts={max_restarts}, "
            "or resume by hand with ckpt_path=<job folder>/checkpoints/last.ckpt"
        )
    elif strategy == "ddp_spawn":
        allowed = (
            "0 with strategy=ddp_spawn: torch.multiprocessing starts its workers and restarts none"
        )
        fix = f"use strategy=ddp (its elastic agent restarts the workers), max_restarts={max_restarts}"
    elif devices == 1:
        allowed = "0 for one process: it trains in the launching process, which nothing restarts"
        fix = (
            "resume by hand with ckpt_path=<job folder>/checkpoints/last.ckpt, or train on "
            f"devices >= 2 with strategy=ddp, max_restarts={max_restarts}"
        )
    else:
        return
    raise ConfigError("max_restarts", max_restarts, allowed, fix)


def _agree(key: str, value: object, started: int, flag: str, world: LaunchedWorld) -> int:
    if value == AUTO:
        return started
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == started:
        return int(value)
    unit = "processes on this node" if key == "devices" else "nodes"
    if "=" in flag:
        other_start = f"start the job with {world.starter} {flag.split('=')[0]}={value}"
    else:
        other_start = f"have {world.starter} start {value} {unit.split(' ')[0]}"
    raise ConfigError(
        key,
        value,
        f"{world.starter} started {started} {unit} ({flag}) and each process is one rank, "
        f"so {key} must be {started}",
        f"leave {key} out ({key}=auto takes it from {world.starter}), or {other_start}",
    )
