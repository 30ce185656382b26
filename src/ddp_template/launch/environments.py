"""Lightning cluster environments for starters Lightning does not rank by itself.

Lightning detects torchrun, SLURM batch jobs and LSF's jsrun on its own, never a Kubeflow
PyTorchJob (its `KubeflowEnvironment` must be given, `starters.KUBEFLOW`), and MPI only
through mpi4py (not a dependency here): `OpenMPIEnvironment` ranks Open MPI's processes
from its variables.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments import ClusterEnvironment

# Open MPI's id of the mpirun job, the same in all its processes (Open MPI's own spelling).
OMPI_JOB_ID = "OMPI_MCA_ess_base_jobid"


class OpenMPIEnvironment(ClusterEnvironment):
    """Processes started by Open MPI's mpirun, ranked from its variables (no mpi4py).

    Ranks are placed node by node (Open MPI's default mapping), so the node rank is the
    global rank over the processes per node. Rank 0 listens on MASTER_ADDR:MASTER_PORT
    where given (`mpirun -x MASTER_ADDR=... -x MASTER_PORT=...`, required on several
    nodes: `starters.MPIRUN`); on one node on the loopback address, at a port every
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
