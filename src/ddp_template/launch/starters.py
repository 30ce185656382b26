"""Who started the processes: one entry per external starter, read everywhere else.

torchrun, srun, a Kubeflow PyTorchJob, Open MPI's mpirun and LSF's jsrun start every
process of a job themselves, each running `train.py` as one rank. (They are *starters*
here; a *Hydra launcher*, `launcher=slurm|packed|submitit_local`, is what submits a job.)
Everything the project needs to know about a starter is in its `Starter` entry: how it is
detected, the world it started (processes per node, nodes), the variable holding a rank,
the job's folder, how to ask it for GPUs, Lightning's cluster environment for it, and who
restarts its processes. `STARTERS` lists them in the order they are detected (torchrun
first: srun or mpirun may run torchrun); `register` adds one (docs/launching.md, "Adding
a starter").
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    KubeflowEnvironment,
    SLURMEnvironment,
)

from ddp_template.errors import ConfigError, UserFacingError
from ddp_template.launch.environments import OMPI_JOB_ID, OpenMPIEnvironment

STAMP_FORMAT = "%Y-%m-%d/%H-%M-%S"


@dataclass(frozen=True)
class LaunchedWorld:
    """What an external starter started, as it told the processes."""

    starter: str
    processes_per_node: int
    nodes: int
    # The starter's own words for the two numbers, for messages.
    processes_flag: str
    nodes_flag: str


def _none() -> None:
    return None


@dataclass(frozen=True)
class Starter:
    """One external starter of processes."""

    name: str
    # True in a process this starter started as one of several.
    detect: Callable[[], bool]
    # The world it started; `devices` is the value named in an error. Raises
    # UserFacingError where its processes cannot be ranked as one job.
    world: Callable[[object], LaunchedWorld]
    # Where it writes a process's global rank (RANK is read first in any case).
    rank_variable: str = "RANK"
    # The folder name all ranks of one job agree on (None: the launching process's stamp).
    job_folder: Callable[[], str | None] = _none
    # How to ask it for one GPU per process.
    gpu_request: str = "ask the starter for one GPU per process"
    # The Trainer's cluster environment; None where Lightning detects the starter itself.
    environment: Callable[[], ClusterEnvironment | None] = _none
    # max_restarts > 0 under it: (what is allowed, the fix); None: it restarts nothing.
    restarts: tuple[str, str] | None = None


STARTERS: list[Starter] = []


def register(starter: Starter, before: str | None = None) -> None:
    """Add a starter (replacing one of the same name), detected before `before`'s entry
    (a starter that can run inside another, as torchrun inside srun, comes first)."""
    unregister(starter.name)
    names = [entry.name for entry in STARTERS]
    STARTERS.insert(names.index(before) if before in names else len(STARTERS), starter)


def unregister(name: str) -> None:
    STARTERS[:] = [entry for entry in STARTERS if entry.name != name]


def current() -> Starter | None:
    """The starter of this process, or None when it is the job's launching process and
    starts the workers itself."""
    return next((entry for entry in STARTERS if entry.detect()), None)


def started_by() -> str | None:
    """The name of this process's starter (`current`), or None."""
    entry = current()
    return entry.name if entry else None


def cluster_environment() -> ClusterEnvironment | None:
    """The environment to give the Trainer, or None where Lightning finds it itself."""
    entry = current()
    return entry.environment() if entry else None


def process_stamp(pid: int) -> str:
    """Start time and id of a process: a folder name unique across jobs."""
    import psutil

    started = psutil.Process(pid).create_time()
    return time.strftime(STAMP_FORMAT, time.localtime(started)) + f"_{pid}"


def env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.isdigit() else default


# torchrun (or another elastic agent) ---------------------------------------------------


def _torchrun_world(devices: object) -> LaunchedWorld:
    per_node = env_int("LOCAL_WORLD_SIZE", 1)
    nodes = env_int("GROUP_WORLD_SIZE", 1)
    world_size = env_int("WORLD_SIZE", per_node * nodes)
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


def _torchrun_folder() -> str:
    """With several nodes, the rendezvous id (`--rdzv-id`) when one is given; else the
    local agent's start time and id, shared by the ranks it starts and by their restarts
    (so a restarted attempt finds the first one's checkpoints)."""
    run_id = os.environ["TORCHELASTIC_RUN_ID"]
    if env_int("GROUP_WORLD_SIZE", 1) > 1 and run_id != "none":
        return f"torchrun/{run_id}"
    return process_stamp(os.getppid())


TORCHRUN = Starter(
    name="torchrun",
    detect=lambda: "TORCHELASTIC_RUN_ID" in os.environ,
    world=_torchrun_world,
    job_folder=_torchrun_folder,
    gpu_request="run torchrun on a machine with GPUs, with CUDA_VISIBLE_DEVICES listing them",
    restarts=(
        "0 under torchrun: torchrun started the processes and only torchrun restarts them",
        "drop max_restarts and give torchrun --max-restarts={max_restarts} (the same on "
        "every node, with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment so "
        "that each attempt gets a fresh rendezvous store); each restart resumes from the "
        "job's last.ckpt",
    ),
)


# SLURM's srun --------------------------------------------------------------------------


def interactive_srun_task() -> bool:
    """A task of srun inside an interactive allocation (not its shell: that is no task)."""
    from lightning.fabric.plugins.environments.slurm import _is_slurm_interactive_mode

    return (
        _is_slurm_interactive_mode()
        and "SLURM_PROCID" in os.environ
        and ("SLURM_STEP_ID" in os.environ or "SLURM_STEPID" in os.environ)
    )


def _srun_tasks() -> bool:
    """Tasks of srun (more than one). Lightning's test, plus srun inside an interactive
    allocation (job name `bash` or `interactive`), which Lightning leaves to "another
    environment": its tasks are ranks of one job all the same (Lightning's SLURM
    environment is then given to the Trainer)."""
    if env_int("SLURM_NTASKS", 1) <= 1:
        return False
    return SLURMEnvironment.detect() or interactive_srun_task()


def _srun_world(devices: object) -> LaunchedWorld:
    tasks = env_int("SLURM_NTASKS", 1)
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
    nodes = env_int("SLURM_STEP_NUM_NODES", env_int("SLURM_NNODES", 0)) or tasks // max(per_node, 1)
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


def _srun_folder() -> str | None:
    if "SLURM_JOB_ID" not in os.environ:
        return None
    return f"slurm/{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_STEP_ID', '0')}"


def _srun_environment() -> ClusterEnvironment | None:
    # Lightning detects batch jobs; nothing requeues a step of an interactive allocation.
    return SLURMEnvironment(auto_requeue=False) if interactive_srun_task() else None


SRUN = Starter(
    name="srun",
    detect=_srun_tasks,
    world=_srun_world,
    rank_variable="SLURM_PROCID",
    job_folder=_srun_folder,
    gpu_request="ask SLURM for GPUs: sbatch/srun --gpus-per-node=<devices> (or --gres=gpu:<devices>)",
    environment=_srun_environment,
    restarts=(
        "0 under srun: SLURM started the tasks, and a failed task ends the job step",
        "drop max_restarts; let SLURM requeue the job (sbatch --requeue, or a preemption "
        "with launcher=slurm), or resume by hand with ckpt_path=<job folder>/checkpoints/"
        "last.ckpt",
    ),
)


# LSF's jsrun ---------------------------------------------------------------------------


def _jsrun_world(devices: object) -> LaunchedWorld:
    # Lightning's own test, so that both agree on who ranks the processes.
    from lightning.fabric.plugins.environments import LSFEnvironment

    size = env_int("JSM_NAMESPACE_SIZE", 1)
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
    per_node = env_int("JSM_NAMESPACE_LOCAL_SIZE", size // nodes)
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


JSRUN = Starter(
    name="jsrun",
    detect=lambda: env_int("JSM_NAMESPACE_SIZE", 1) > 1,
    world=_jsrun_world,
    rank_variable="JSM_NAMESPACE_RANK",
    job_folder=lambda: f"lsf/{os.environ['LSB_JOBID']}" if "LSB_JOBID" in os.environ else None,
    gpu_request="ask jsrun for GPUs: jsrun --gpu_per_rs=1 (or bsub -gpu num=<devices>)",
)


# Open MPI's mpirun ---------------------------------------------------------------------


def _mpirun_world(devices: object) -> LaunchedWorld:
    size = env_int("OMPI_COMM_WORLD_SIZE", 1)
    per_node = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", 0)
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


MPIRUN = Starter(
    name="mpirun",
    detect=lambda: env_int("OMPI_COMM_WORLD_SIZE", 1) > 1,
    world=_mpirun_world,
    rank_variable="OMPI_COMM_WORLD_RANK",
    job_folder=lambda: f"mpirun/{os.environ[OMPI_JOB_ID]}" if OMPI_JOB_ID in os.environ else None,
    gpu_request="run mpirun on GPU nodes, with CUDA_VISIBLE_DEVICES listing the GPUs (-x CUDA_VISIBLE_DEVICES)",
    # Lightning detects MPI only through mpi4py, not a dependency here.
    environment=OpenMPIEnvironment,
)


# MPICH's or Intel MPI's mpiexec: refused --------------------------------------------------


def _mpiexec_world(devices: object) -> LaunchedWorld:
    raise UserFacingError(
        f"mpiexec (MPICH or Intel MPI: PMI_SIZE={os.environ['PMI_SIZE']}) started this "
        "process as one of several, and its environment does not say where the first "
        "rank listens, so the processes cannot form one job (each would train alone into "
        "the same folder). Start one torchrun per node instead (mpiexec -n <nodes> -ppn 1 "
        "torchrun --nnodes=<nodes> --nproc_per_node=<devices> --rdzv_backend=c10d "
        "--rdzv_endpoint=<first node>:29500 train.py ...), or use Open MPI's mpirun."
    )


MPIEXEC = Starter(
    name="mpiexec",
    detect=lambda: env_int("PMI_SIZE", 1) > 1,
    world=_mpiexec_world,
    rank_variable="PMI_RANK",
)


# A Kubeflow PyTorchJob -------------------------------------------------------------------


def _kubeflow_detect() -> bool:
    pytorch_job = all(name in os.environ for name in ("RANK", "MASTER_ADDR", "MASTER_PORT"))
    return pytorch_job and env_int("WORLD_SIZE", 1) > 1


def _kubeflow_world(devices: object) -> LaunchedWorld:
    nodes = env_int("WORLD_SIZE", 1)
    return LaunchedWorld("kubeflow", 1, nodes, "one process per replica", f"{nodes} replicas")


KUBEFLOW = Starter(
    name="kubeflow",
    detect=_kubeflow_detect,
    world=_kubeflow_world,
    # rank 0's address and port (the master replica's service): a PyTorchJob run again
    # under the same name continues in its folder.
    job_folder=lambda: f"kubeflow/{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}",
    gpu_request="give each PyTorchJob replica a GPU: resources.limits nvidia.com/gpu: 1",
    # Lightning never detects it: its environment must be given.
    environment=KubeflowEnvironment,
)


for _starter in (TORCHRUN, SRUN, JSRUN, MPIRUN, MPIEXEC, KUBEFLOW):
    register(_starter)
