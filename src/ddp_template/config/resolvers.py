"""OmegaConf resolvers used by `conf/`.

When an external starter (torchrun, srun, Kubeflow, mpirun, jsrun: `launch/starters.py`)
starts the processes,
every rank runs `train.py` and composes the config itself. These resolvers make all ranks of one job agree on one folder, and keep the
non-zero ranks from writing Hydra's files into it.
"""

from __future__ import annotations

import os
import time

from omegaconf import OmegaConf

from ddp_template import metrics
from ddp_template.launch import slurm, starters
from ddp_template.launch.cuda_devices import on_cuda
from ddp_template.launch.topology import workers_per_rank


def launch_rank() -> int:
    """Global rank given by an external starter (RANK, else the starter's own variable:
    srun's SLURM_PROCID, mpirun's OMPI_COMM_WORLD_RANK, ...); 0 else."""
    starter = starters.current()
    names = ("RANK", starter.rank_variable) if starter else ("RANK",)
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return 0


def job_stamp(job_id: object = None, master_addr: object = None, num_nodes: object = 1) -> str:
    """Name of a job's folder: the same in every process of the job, unique across jobs.

    - plain command: start time and process id of this (the launching) process;
    - an external starter: its entry's `job_folder` (torchrun: the rendezvous id with
      several nodes, else the local agent's stamp; srun: the SLURM job and step ids;
      Kubeflow: rank 0's address and port; mpirun: the Open MPI job id; jsrun: the LSF job
      id), or the launching process's stamp where it gives none;
    - this project's own agent on several nodes (`network.master_addr`): `nodes/<job_id>`,
      or the minute the node started when no `network.job_id` is given.
    """
    starter = starters.current()
    own_nodes = master_addr not in (None, "") and num_nodes not in (1, "1", "auto", None)
    if own_nodes and (starter is None or starter.name != "torchrun"):
        return f"nodes/{job_id or time.strftime('%Y-%m-%d_%H-%M')}"
    folder = starter.job_folder() if starter else None
    return folder or starters.process_stamp(os.getpid())


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
