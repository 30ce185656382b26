"""The Trainer's cluster environment for launchers Lightning does not pick by itself.

Lightning detects torchrun, SLURM batch jobs and LSF's jsrun on its own. It never detects
a Kubeflow PyTorchJob (its `KubeflowEnvironment` must be given), detects MPI only through
mpi4py (not a dependency here), and leaves srun inside an interactive allocation to
"another environment". For those, `cluster_environment` gives the Trainer the one that
ranks the processes as the launcher did, so that they train as one job.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import (
    ClusterEnvironment,
    KubeflowEnvironment,
    SLURMEnvironment,
)

from ddp_template.launch.world import OMPI_JOB_ID, interactive_srun_task, started_by


def cluster_environment() -> ClusterEnvironment | None:
    """The environment to give the Trainer, or None where Lightning finds it itself."""
    launcher = started_by()
    if launcher == "kubeflow":
        return KubeflowEnvironment()
    if launcher == "mpirun":
        return OpenMPIEnvironment()
    if launcher == "srun" and interactive_srun_task():
        # Nothing requeues a step of an interactive allocation.
        return SLURMEnvironment(auto_requeue=False)
    return None


class OpenMPIEnvironment(ClusterEnvironment):
    """Processes started by Open MPI's mpirun, ranked from its variables (no mpi4py).

    Ranks are placed node by node (Open MPI's default mapping), so the node rank is the
    global rank over the processes per node. Rank 0 listens on MASTER_ADDR:MASTER_PORT
    where given (`mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`, required on several
    nodes: `world.launched_world`); on one node on the loopback address, at a port every
    rank derives from the mpirun job's id.
    """

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        if "MASTER_PORT" in os.environ:
            return int(os.environ["MASTER_PORT"])
        return job_port(os.environ.get(OMPI_JOB_ID, "0"))

    @staticmethod
    def detect() -> bool:
        return "OMPI_COMM_WORLD_SIZE" in os.environ

    def world_size(self) -> int:
        return int(os.environ["OMPI_COMM_WORLD_SIZE"])

    def set_world_size(self, size: int) -> None:
        pass  # mpirun decided it

    def global_rank(self) -> int:
        return int(os.environ["OMPI_COMM_WORLD_RANK"])

    def set_global_rank(self, rank: int) -> None:
        pass  # mpirun decided it

    def local_rank(self) -> int:
        return int(os.environ["OMPI_COMM_WORLD_LOCAL_RANK"])

    def node_rank(self) -> int:
        return self.global_rank() // int(os.environ["OMPI_COMM_WORLD_LOCAL_SIZE"])


def job_port(job_id: str) -> int:
    """A port in 15000-34999 that every rank of one job computes alike."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return 15000 + int(digits) % 20000
