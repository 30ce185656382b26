"""Launchers beside torchrun and SLURM batch jobs: a Kubeflow PyTorchJob, Open MPI's mpirun,
LSF's jsrun and srun inside an interactive allocation each train one job of the launcher's
world size, in one folder all ranks agree on; MPICH's mpiexec, and mpirun on several nodes
without an address for rank 0, stop every process at start-up with one paragraph."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.runs import FAST, ROOT, compose_train, free_port, results, start, subprocess_env

from ddp_template.build import build_trainer
from ddp_template.config import resolvers
from ddp_template.config.checks import resolve_and_check
from ddp_template.errors import ConfigError, UserFacingError
from ddp_template.launch.world import launched_world, started_by

TINY = ["strategy=ddp", *FAST]
# Every variable a launcher sets, cleared before a test sets its own.
LAUNCHER_VARIABLES = (
    "TORCHELASTIC_RUN_ID",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "LSB_JOBID",
)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch):
    """Sets a launcher's environment for this process (cleared of any other's)."""
    for name in list(os.environ):
        if name.startswith(("SLURM_", "JSM_", "LSB_", "OMPI_", "PMI_")) or name in (
            LAUNCHER_VARIABLES
        ):
            monkeypatch.delenv(name)

    def setenv(**variables: str) -> None:
        for name, value in variables.items():
            monkeypatch.setenv(name, value)

    return setenv


def kubeflow_env(rank: int, port: int) -> dict[str, str]:
    """What a PyTorchJob gives each replica (one process per pod; the master's service
    name is the address, here the loopback)."""
    return {
        "WORLD_SIZE": "2",
        "RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "KUBERNETES_PORT": "tcp://10.96.0.1:443",
    }


@pytest.mark.slow
def test_a_pytorchjob_trains_one_job_across_its_replicas(tmp_path: Path) -> None:
    """Two processes with the environment of a PyTorchJob's two replicas: one 2-rank job
    (each replica a node of one process), one folder, the test metric of the whole job."""
    port = free_port()
    replicas = [
        start(
            [sys.executable, str(ROOT / "train.py"), *TINY], cwd=tmp_path, env=kubeflow_env(r, port)
        )
        for r in (0, 1)
    ]
    outputs = [replica.communicate(timeout=400) for replica in replicas]
    assert [r.returncode for r in replicas] == [0, 0], [o[1][-3000:] for o in outputs]
    (job,) = (tmp_path / "outputs" / "kubeflow").iterdir()
    assert job.name == f"127.0.0.1_{port}"
    found = results(job)
    assert (found["world_size"], found["num_nodes"], found["devices_per_node"]) == (2, 2, 1)
    assert "test/acc" in found


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun (openmpi-bin) is not installed")
def test_mpirun_trains_one_job_of_its_processes(tmp_path: Path) -> None:
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    proc = subprocess.run(
        ["mpirun", *as_root, "--oversubscribe", "-np", "2", "-x", "PYTHONPATH"]
        + [sys.executable, str(ROOT / "train.py"), *TINY],
        cwd=tmp_path,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (job,) = (tmp_path / "outputs" / "mpirun").iterdir()
    found = results(job)
    assert (found["world_size"], found["num_nodes"], found["devices_per_node"]) == (2, 1, 2)
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in proc.stdout + proc.stderr


def test_srun_inside_an_interactive_allocation_is_one_job(launched, tmp_path: Path) -> None:
    """Lightning leaves srun's tasks of an allocation named `interactive` undetected: the
    Trainer gets the SLURM environment, and each task is the rank srun gave it."""
    launched(
        SLURM_JOB_NAME="interactive",
        SLURM_JOB_ID="77",
        SLURM_STEP_ID="3",
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NNODES="1",
        SLURM_PROCID="1",
        SLURM_LOCALID="1",
        SLURM_NODEID="0",
        SLURM_NODELIST="localhost",
    )
    assert started_by() == "srun"
    assert resolvers.job_stamp() == "slurm/77.3"
    assert resolvers.launch_rank() == 1
    trainer = trained_as(tmp_path)
    assert (trainer.world_size, trainer.global_rank, trainer.local_rank) == (2, 1, 1)


def test_jsrun_is_one_job(launched, tmp_path: Path) -> None:
    """LSF's jsrun: Lightning's LSFEnvironment ranks the processes; the rank file's hosts
    (the first line is the launch node) count the nodes."""
    rankfile = tmp_path / "rankfile"
    host = socket.gethostname()
    rankfile.write_text(f"launchnode\n{host}\n{host}\n")
    launched(
        LSB_JOBID="5151",
        LSB_DJOB_RANKFILE=str(rankfile),
        JSM_NAMESPACE_SIZE="2",
        JSM_NAMESPACE_LOCAL_SIZE="2",
        JSM_NAMESPACE_RANK="1",
        JSM_NAMESPACE_LOCAL_RANK="1",
    )
    assert started_by() == "jsrun"
    world = launched_world()
    assert world is not None and (world.processes_per_node, world.nodes) == (2, 1)
    assert resolvers.job_stamp() == "lsf/5151"
    assert resolvers.launch_rank() == 1
    trainer = trained_as(tmp_path)
    assert (trainer.world_size, trainer.global_rank) == (2, 1)


def test_jsrun_without_lsf_variables_is_refused(launched) -> None:
    launched(JSM_NAMESPACE_SIZE="2", JSM_NAMESPACE_RANK="0", JSM_NAMESPACE_LOCAL_RANK="0")
    with pytest.raises(UserFacingError, match="LSB_JOBID, LSB_DJOB_RANKFILE is unset"):
        resolve_and_check(compose_train(*TINY))


def test_mpirun_ranks_agree_on_one_folder_and_a_port(launched) -> None:
    stamps, ports = set(), set()
    for rank in (0, 1):
        launched(
            OMPI_COMM_WORLD_SIZE="2",
            OMPI_COMM_WORLD_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_RANK=str(rank),
            OMPI_COMM_WORLD_LOCAL_SIZE="2",
            OMPI_MCA_ess_base_jobid="2018246657",
        )
        from ddp_template.launch.starters import cluster_environment

        environment = cluster_environment()
        assert environment is not None and environment.global_rank() == rank
        stamps.add(resolvers.job_stamp())
        ports.add(environment.main_port)
    assert stamps == {"mpirun/2018246657"} and len(ports) == 1


def test_mpirun_on_several_nodes_needs_the_first_nodes_address(launched) -> None:
    launched(
        OMPI_COMM_WORLD_SIZE="4",
        OMPI_COMM_WORLD_RANK="0",
        OMPI_COMM_WORLD_LOCAL_RANK="0",
        OMPI_COMM_WORLD_LOCAL_SIZE="2",
    )
    with pytest.raises(UserFacingError, match="mpirun -x MASTER_ADDR="):
        launched_world()


def test_mpich_is_refused_with_the_fix(launched) -> None:
    launched(PMI_SIZE="2", PMI_RANK="1")
    with pytest.raises(UserFacingError, match=r"mpiexec \(MPICH or Intel MPI: PMI_SIZE=2\)"):
        resolve_and_check(compose_train(*TINY))


def test_a_pytorchjob_replica_is_one_device(launched) -> None:
    launched(**kubeflow_env(1, 29500))
    assert resolvers.job_stamp() == "kubeflow/127.0.0.1_29500"
    with pytest.raises(ConfigError, match="kubeflow started 1 processes on this node"):
        resolve_and_check(compose_train(*TINY, "devices=2"))


def trained_as(tmp_path: Path):
    cfg = compose_train(*TINY)
    resolve_and_check(cfg)
    cfg.paths.output_dir = str(tmp_path / "run")
    return build_trainer(cfg, loggers=[])


def test_a_starter_added_to_the_table_is_read_everywhere(launched) -> None:
    """One entry in `starters` is all a new starter needs: detection, the world it
    started, the rank, the job's folder, the GPU advice, the cluster environment and the
    restart advice are each read from it."""
    from lightning.fabric.plugins.environments import LightningEnvironment

    from ddp_template.config.checks import resolve_accelerator
    from ddp_template.launch import starters
    from ddp_template.launch.world import check_restarts, take_launched_world

    environment = LightningEnvironment()
    pbs = starters.Starter(
        name="pbs",
        detect=lambda: "PBS_JOBID" in os.environ,
        world=lambda devices: starters.LaunchedWorld("pbs", 2, 3, "-l ncpus=2", "-l nodes=3"),
        rank_variable="PBS_TASKNUM",
        job_folder=lambda: f"pbs/{os.environ['PBS_JOBID']}",
        gpu_request="ask PBS for GPUs: qsub -l ngpus=<devices>",
        environment=lambda: environment,
        restarts=("0 under pbs", "qsub -r y, {max_restarts} times"),
    )
    starters.register(pbs, before="torchrun")
    try:
        launched(PBS_JOBID="4242.server", PBS_TASKNUM="5")
        assert started_by() == "pbs"
        assert take_launched_world("auto", "auto") == (2, 3)
        assert resolvers.launch_rank() == 5
        assert resolvers.job_stamp() == "pbs/4242.server"
        assert starters.cluster_environment() is environment
        with pytest.raises(ConfigError, match="qsub -r y, 3 times"):
            check_restarts(3, "ddp", 2)
        with pytest.raises(ConfigError, match="devices=4 is not valid: pbs started 2"):
            take_launched_world(4, "auto")
        if not torch.cuda.is_available():
            with pytest.raises(ConfigError, match=r"qsub -l ngpus=<devices>"):
                resolve_accelerator("gpu")
    finally:
        starters.unregister("pbs")
    assert started_by() is None
