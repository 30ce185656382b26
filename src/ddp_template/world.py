"""The processes of a job: who started them, how many per node, on how many nodes, and who
restarts them.

torchrun and srun start every process of a job themselves; each runs `train.py` as one
rank. `devices` (processes per node) and `num_nodes` are then facts about what was
started, read from the launcher's environment: `auto` (the default) takes them, and a
number that disagrees stops every process before training. Without an external launcher,
`devices=auto` is every visible GPU (1 on the CPU) and `num_nodes=auto` is 1.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

from ddp_template.errors import ConfigError

AUTO = "auto"


@dataclass(frozen=True)
class LaunchedWorld:
    """What an external launcher started, as it told the processes."""

    launcher: str  # "torchrun" or "srun"
    processes_per_node: int
    nodes: int
    # The launcher's own words for the two numbers, for messages.
    processes_flag: str
    nodes_flag: str


def started_by() -> str | None:
    """Who started this process: torchrun (or another elastic agent), srun with several
    tasks, or None when it is the job's launching process and starts the workers itself."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    # Lightning's own test, so that both agree on who ranks the processes.
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if SLURMEnvironment.detect() and _env_int("SLURM_NTASKS", 1) > 1:
        return "srun"
    return None


def launched_world(devices: object = AUTO) -> LaunchedWorld | None:
    """The processes per node and nodes the external launcher started (None without one);
    `devices` is the value named when the launcher's numbers cannot be used."""
    launcher = started_by()
    if launcher == "torchrun":
        return _torchrun_world(devices)
    if launcher == "srun":
        return _srun_world(devices)
    return None


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
    launcher = started_by()
    if launcher == "torchrun":
        allowed = "0 under torchrun: torchrun started the processes and only torchrun restarts them"
        fix = (
            f"drop max_restarts and give torchrun --max-restarts={max_restarts} (the same on "
            "every node, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment so "
            "that each attempt gets a fresh rendezvous store); each restart resumes from the "
            "job's last.ckpt"
        )
    elif launcher == "srun":
        allowed = "0 under srun: SLURM started the tasks, and a failed task ends the job step"
        fix = (
            "drop max_restarts; let SLURM requeue the job (sbatch --requeue, or a preemption "
            "with launcher=slurm), or resume by hand with ckpt_path=<job folder>/checkpoints/"
            "last.ckpt"
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


def _torchrun_world(devices: object) -> LaunchedWorld:
    per_node = _env_int("LOCAL_WORLD_SIZE", 1)
    nodes = _env_int("GROUP_WORLD_SIZE", 1)
    world_size = _env_int("WORLD_SIZE", per_node * nodes)
    if world_size != per_node * nodes:
        raise ConfigError(
            "devices",
            devices,
            f"the same number of processes on every node; torchrun started {world_size} "
            f"processes on {nodes} nodes ({per_node} on this one)",
            "give every node the same --nproc_per_node",
        )
    return LaunchedWorld(
        "torchrun",
        per_node,
        nodes,
        processes_flag=f"--nproc_per_node={per_node}",
        nodes_flag=f"--nnodes={nodes}",
    )


def _srun_world(devices: object) -> LaunchedWorld:
    tasks = _env_int("SLURM_NTASKS", 1)
    if "SLURM_NTASKS_PER_NODE" not in os.environ:
        raise ConfigError(
            "devices",
            devices,
            f"a known number of tasks per node; srun started {tasks} tasks without "
            "--ntasks-per-node (SLURM_NTASKS_PER_NODE is unset), and Lightning needs it",
            f"submit with --ntasks-per-node=<devices> instead of --ntasks={tasks}",
        )
    # A single number, or SLURM's compressed form for the same count on every node: 2(x4).
    per_node_text = os.environ["SLURM_NTASKS_PER_NODE"].split("(")[0]
    per_node = int(per_node_text) if per_node_text.isdigit() else 0
    nodes = _env_int("SLURM_STEP_NUM_NODES", _env_int("SLURM_NNODES", 0)) or tasks // max(
        per_node, 1
    )
    if per_node < 1 or per_node * nodes != tasks:
        raise ConfigError(
            "devices",
            devices,
            f"the same number of tasks on every node; srun started {tasks} tasks on {nodes} "
            f"nodes with SLURM_NTASKS_PER_NODE={os.environ['SLURM_NTASKS_PER_NODE']}",
            "submit with --nodes=<num_nodes> --ntasks-per-node=<devices>",
        )
    return LaunchedWorld(
        "srun",
        per_node,
        nodes,
        processes_flag=f"--ntasks-per-node={per_node}",
        nodes_flag=f"--nodes={nodes}",
    )


def _agree(key: str, value: object, started: int, flag: str, world: LaunchedWorld) -> int:
    if value == AUTO:
        return started
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == started:
        return int(value)
    unit = "processes on this node" if key == "devices" else "nodes"
    wanted_flag = flag.split("=")[0] + f"={value}"
    raise ConfigError(
        key,
        value,
        f"{world.launcher} started {started} {unit} ({flag}) and each process is one rank, "
        f"so {key} must be {started}",
        f"leave {key} out ({key}=auto takes it from {world.launcher}), or start the job with "
        f"{world.launcher} {wanted_flag}",
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default
