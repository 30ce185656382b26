"""The processes of a job: who started them, how many per node, on how many nodes, and who
restarts them.

torchrun, srun, a Kubeflow PyTorchJob, Open MPI's mpirun and LSF's jsrun start every
process of a job themselves; each runs `train.py` as one rank (docs/nodes.md has a row
per launcher). `devices` (processes per node) and `num_nodes` are then facts about what
was started, read from the launcher's environment: `auto` (the default) takes them, and a
number that disagrees stops every process before training. Launchers whose processes
cannot be ranked from their environment (MPICH's or Intel MPI's mpiexec; mpirun on
several nodes without MASTER_ADDR) are refused in every process, before training, rather
than left to train one independent job per process. Without an external launcher,
`devices=auto` is every visible GPU (1 on the CPU) and `num_nodes=auto` is 1.
"""

from __future__ import annotations

import numbers
import os
from dataclasses import dataclass

from ddp_template.errors import ConfigError, UserFacingError

AUTO = "auto"
# Open MPI's id of the mpirun job, the same in all its processes (Open MPI's own spelling).
OMPI_JOB_ID = "OMPI_MCA_ess_base_jobid"


@dataclass(frozen=True)
class LaunchedWorld:
    """What an external launcher started, as it told the processes."""

    launcher: str  # "torchrun", "srun", "kubeflow", "mpirun" or "jsrun"
    processes_per_node: int
    nodes: int
    # The launcher's own words for the two numbers, for messages.
    processes_flag: str
    nodes_flag: str


def started_by() -> str | None:
    """Who started this process: torchrun (or another elastic agent), srun with several
    tasks, a Kubeflow PyTorchJob, mpirun, jsrun (LSF), MPICH's mpiexec (refused), or None
    when it is the job's launching process and starts the workers itself."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if _srun_tasks():
        return "srun"
    if _env_int("JSM_NAMESPACE_SIZE", 1) > 1:
        return "jsrun"
    if _env_int("OMPI_COMM_WORLD_SIZE", 1) > 1:
        return "mpirun"
    if _env_int("PMI_SIZE", 1) > 1:
        return "mpiexec"
    pytorch_job = all(name in os.environ for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"))
    if pytorch_job and _env_int("WORLD_SIZE", 1) > 1:
        return "kubeflow"
    return None


def _srun_tasks() -> bool:
    """Tasks of srun (more than one). Lightning's test, plus srun inside an interactive
    allocation (job name `bash` or `interactive`), which Lightning leaves to "another
    environment": its tasks are ranks of one job all the same (Lightning's SLURM
    environment is then given to the Trainer, `environments.cluster_environment`)."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    if _env_int("SLURM_NTASKS", 1) <= 1:
        return False
    return SLURMEnvironment.detect() or interactive_srun_task()


def interactive_srun_task() -> bool:
    """A task of srun inside an interactive allocation (not its shell: that is no task)."""
    from lightning.fabric.plugins.environments.slurm import _is_slurm_interactive_mode

    return (
        _is_slurm_interactive_mode()
        and "SLURM_PROCID" in os.environ
        and ("SLURM_STEP_ID" in os.environ or "SLURM_STEPID" in os.environ)
    )


def launched_world(devices: object = AUTO) -> LaunchedWorld | None:
    """The processes per node and nodes the external launcher started (None without one);
    `devices` is the value named when the launcher's numbers cannot be used. Raises
    UserFacingError for a launcher whose processes cannot be one job."""
    launcher = started_by()
    if launcher == "torchrun":
        return _torchrun_world(devices)
    if launcher == "srun":
        return _srun_world(devices)
    if launcher == "kubeflow":
        nodes = _env_int("WORLD_SIZE", 1)
        return LaunchedWorld("kubeflow", 1, nodes, "one process per replica", f"{nodes} replicas")
    if launcher == "mpirun":
        return _mpirun_world(devices)
    if launcher == "jsrun":
        return _jsrun_world(devices)
    if launcher == "mpiexec":
        raise UserFacingError(
            f"mpiexec (MPICH or Intel MPI: PMI_SIZE={os.environ['PMI_SIZE']}) started this "
            "process as one of several, and its environment does not say where the first "
            "rank listens, so the processes cannot form one job (each would train alone into "
            "the same folder). Start one torchrun per node instead (mpiexec -n <nodes> -ppn 1 "
            "torchrun --nnodes=<nodes> --nproc_per_node=<devices> --rdzv_backend=c10d "
            "--rdzv_endpoint=<first node>:29500 train.py ...), or use Open MPI's mpirun."
        )
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
    elif launcher is not None:
        allowed = f"0 under {launcher}: {launcher} started the processes, and restarts none"
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


def _mpirun_world(devices: object) -> LaunchedWorld:
    size = _env_int("OMPI_COMM_WORLD_SIZE", 1)
    per_node = _env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 0)
    if per_node < 1 or size % per_node:
        raise ConfigError(
            "devices",
            devices,
            f"the same number of processes on every node; mpirun started {size} processes "
            f"with {per_node} on this node",
            "give mpirun the same count per node: mpirun -np <nodes x devices> --map-by "
            "ppr:<devices>:node",
        )
    nodes = size // per_node
    if nodes > 1 and "MASTER_ADDR" not in os.environ:
        raise UserFacingError(
            f"mpirun started {size} processes on {nodes} nodes, and nothing tells them where "
            "rank 0 listens (Open MPI does not, and this project needs no mpi4py to ask). "
            "Name the first node for every rank: mpirun -x MASTER_ADDR=<first node's "
            "address> -x MASTER_PORT=29500 ... python train.py ..."
        )
    return LaunchedWorld(
        "mpirun", per_node, nodes, processes_flag=f"-np {size}", nodes_flag=f"{nodes} nodes"
    )


def _jsrun_world(devices: object) -> LaunchedWorld:
    # Lightning's own test, so that both agree on who ranks the processes.
    from lightning.fabric.plugins.environments import LSFEnvironment

    size = _env_int("JSM_NAMESPACE_SIZE", 1)
    if not LSFEnvironment.detect():
        wanted = ("LSB_JOBID", "LSB_DJOB_RANKFILE", "JSM_NAMESPACE_LOCAL_RANK")
        missing = ", ".join(name for name in wanted if name not in os.environ)
        raise UserFacingError(
            f"jsrun started this process as one of {size} (JSM_NAMESPACE_SIZE), but {missing} "
            "is unset, so Lightning's LSF environment cannot rank the processes (each would "
            "train alone). Start the job with jsrun inside an LSF job (bsub), which sets them, "
            "or start one torchrun per node instead."
        )
    # The first line of the rank file is the launch node, which runs no rank (Lightning's
    # LSFEnvironment reads it the same way).
    with open(os.environ["LSB_DJOB_RANKFILE"]) as rankfile:
        hosts = [line.strip() for line in rankfile if line.strip()][1:]
    nodes = len(set(hosts)) or 1
    per_node = _env_int("JSM_NAMESPACE_LOCAL_SIZE", size // nodes)
    if per_node * nodes != size:
        raise ConfigError(
            "devices",
            devices,
            f"the same number of processes on every node; jsrun started {size} processes on "
            f"{nodes} nodes ({per_node} on this one)",
            "give every resource set the same number of tasks: jsrun --tasks_per_rs=<devices>",
        )
    return LaunchedWorld(
        "jsrun", per_node, nodes, processes_flag=f"--np={size}", nodes_flag=f"{nodes} nodes"
    )


def _agree(key: str, value: object, started: int, flag: str, world: LaunchedWorld) -> int:
    if value == AUTO:
        return started
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and value == started:
        return int(value)
    unit = "processes on this node" if key == "devices" else "nodes"
    if "=" in flag:
        other_start = f"start the job with {world.launcher} {flag.split('=')[0]}={value}"
    else:
        other_start = f"have {world.launcher} start {value} {unit.split(' ')[0]}"
    raise ConfigError(
        key,
        value,
        f"{world.launcher} started {started} {unit} ({flag}) and each process is one rank, "
        f"so {key} must be {started}",
        f"leave {key} out ({key}=auto takes it from {world.launcher}), or {other_start}",
    )


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default
