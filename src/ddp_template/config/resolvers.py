"""OmegaConf resolvers used by `conf/`.

When an external launcher (torchrun, srun, Kubeflow, mpirun, jsrun) starts the processes,
every rank runs `train.py` and composes the config itself. These resolvers make all ranks of one job agree on one folder, and keep the
non-zero ranks from writing Hydra's files into it.
"""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

from ddp_template import metrics
from ddp_template.launch import slurm
from ddp_template.launch.cuda_devices import on_cuda
from ddp_template.launch.topology import cores_per_process
from ddp_template.launch.world import OMPI_JOB_ID, started_by

STAMP_FORMAT = "%Y-%m-%d/%H-%M-%S"


# Where each launcher writes a process's global rank.
RANK_VARIABLES = {
    "srun": "SLURM_PROCID",
    "mpirun": "OMPI_COMM_WORLD_RANK",
    "jsrun": "JSM_NAMESPACE_RANK",
    "mpiexec": "PMI_RANK",
}


def launch_rank() -> int:
    """Global rank given by an external launcher (torchrun and Kubeflow: RANK, srun:
    SLURM_PROCID, mpirun: OMPI_COMM_WORLD_RANK, jsrun: JSM_NAMESPACE_RANK); 0 else."""
    launcher = started_by()
    names = ("RANK", RANK_VARIABLES[launcher]) if launcher in RANK_VARIABLES else ("RANK",)
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def job_stamp(job_id: object = None, master_addr: object = None, num_nodes: object = 1) -> str:
    """Name of a job's folder: the same in every process of the job, unique across jobs.

    - plain command: start time and process id of this (the launching) process;
    - torchrun: start time and process id of the local elastic agent, shared by the ranks it
      starts and by their restarts (so a restarted attempt finds the first one's checkpoints);
      with several nodes, the rendezvous id (`--rdzv-id`) when one is given;
    - srun: the SLURM job and step ids;
    - Kubeflow: rank 0's address and port (MASTER_ADDR: the PyTorchJob's master replica),
      so a PyTorchJob run again under the same name continues in its folder;
    - mpirun: the Open MPI job id; jsrun: the LSF job id;
    - this project's own agent on several nodes (`network.master_addr`): `nodes/<job_id>`,
      or the minute the node started when no `network.job_id` is given.
    """
    own_nodes = master_addr not in (None, "") and num_nodes not in (1, "1", "auto", None)
    if own_nodes and "TORCHELASTIC_RUN_ID" not in os.environ:
        return f"nodes/{job_id or time.strftime('%Y-%m-%d_%H-%M')}"
    if "TORCHELASTIC_RUN_ID" in os.environ:
        run_id = os.environ["TORCHELASTIC_RUN_ID"]
        several_nodes = int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1
        if several_nodes and run_id != "none":
            return f"torchrun/{run_id}"
        return _process_stamp(os.getppid())
    launcher = started_by()
    if launcher == "srun" and "SLURM_JOB_ID" in os.environ:
        step = os.environ.get("SLURM_STEP_ID", "0")
        return f"slurm/{os.environ['SLURM_JOB_ID']}.{step}"
    if launcher == "kubeflow":
        return f"kubeflow/{os.environ['MASTER_ADDR']}_{os.environ['MASTER_PORT']}"
    if launcher == "mpirun" and OMPI_JOB_ID in os.environ:
        return f"mpirun/{os.environ[OMPI_JOB_ID]}"
    if launcher == "jsrun" and "LSB_JOBID" in os.environ:
        return f"lsf/{os.environ['LSB_JOBID']}"
    return _process_stamp(os.getpid())


def _process_stamp(pid: int) -> str:
    import psutil

    started = psutil.Process(pid).create_time()
    return time.strftime(STAMP_FORMAT, time.localtime(started)) + f"_{pid}"


def if_rank_zero(value: str, node_rank: object = None) -> str | None:
    """`value` on global rank 0, None elsewhere (Hydra then skips that output).
    `node_rank` (`network.node_rank`): this project's agent on a node other than 0."""
    return value if launch_rank() == 0 and node_rank in (None, 0) else None


def rank_zero_file(path: str, node_rank: object = None) -> str:
    """`path` on global rank 0, the null device elsewhere (for log files)."""
    return path if launch_rank() == 0 and node_rank in (None, 0) else os.devnull


def add(*values: int) -> int:
    """`${add:a,b}`: a sum, e.g. warm-up plus measured benchmark steps."""
    return sum(values)


def explicit_or(value: object, default: int) -> object:
    """`${explicit_or:${devices},1}`: a count the user set, else `default` where `auto` cannot
    be resolved yet (a job submitted to SLURM is sized before its tasks exist)."""
    return default if value == "auto" else value


def workers_per_rank(processes_per_node: object, minimum: int = 1) -> int:
    """DataLoader workers for one rank: the cores it may use, less the one it trains on
    (`${workers_per_rank:${devices},0}` allows none when a rank has a single core)."""
    processes = processes_per_node if isinstance(processes_per_node, int) else 1
    return max(minimum, cores_per_process(processes) - 1)


def register() -> None:
    OmegaConf.register_new_resolver("job_stamp", job_stamp, use_cache=True, replace=True)
    OmegaConf.register_new_resolver("if_rank_zero", if_rank_zero, replace=True)
    OmegaConf.register_new_resolver("rank_zero_file", rank_zero_file, replace=True)
    OmegaConf.register_new_resolver("add", add, replace=True)
    OmegaConf.register_new_resolver("explicit_or", explicit_or, replace=True)
    OmegaConf.register_new_resolver("workers_per_rank", workers_per_rank, replace=True)
    OmegaConf.register_new_resolver("on_cuda", on_cuda, replace=True)
    OmegaConf.register_new_resolver("slurm_gpus", slurm.gpus_per_node, replace=True)
    OmegaConf.register_new_resolver(
        "slurm_cpus_per_task", slurm.cpus_per_task, use_cache=True, replace=True
    )
    OmegaConf.register_new_resolver("direction", metrics.direction, replace=True)
