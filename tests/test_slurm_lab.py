"""A multi-node SLURM on the lab (`ddp_template.tools.slurm_lab`): slurmctld and one slurmd
per lab node, each in its node's network namespace with its own hostname and address. DDP
jobs of one task per node through `launcher=slurm` and through a plain `sbatch` of `srun
python train.py`, a preemption that reaches one node only, then a requeue by the
scheduler, and submissions the partition cannot run. The cluster is made for this module
and removed after it; the one-machine SLURM (scripts/slurm_local.sh) is not touched.
Skipped, with the reason, only where the machine cannot make it (and failed then on CI)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.runs import FAST, ROOT, results, subprocess_env
from helpers.slurm_jobs import job_logs, wait_for_step, wait_for_training_again, wait_until

from ddp_template.errors import UserFacingError
from ddp_template.tools.slurm_lab import SlurmLab

# One SLURM and one lab at a time: under pytest-xdist (README's test command) the tests of
# this group run in one worker, one after another (their clusters share names, addresses
# and the one-machine SLURM's CPUs).
pytestmark = pytest.mark.xdist_group("cluster")

PYTHON = sys.executable
TRAIN = str(ROOT / "train.py")
# One task on each of the two nodes, one CPU each: world size 2 over the lab's link.
TWO_NODES = ["strategy=ddp", "num_nodes=2", "devices=1"]


@pytest.fixture(scope="module")
def cluster():
    try:
        made = SlurmLab.up(2, prefix="sl")
    except UserFacingError as why:
        pytest.skip(str(why))
    yield made
    made.down()


def _queued(cluster: SlurmLab) -> list[str]:
    return cluster.run(["squeue", "--noheader", "--format=%i"]).stdout.split()


def _job_state(cluster: SlurmLab, job_id: str) -> dict[str, str]:
    out = cluster.run(["scontrol", "show", "job", job_id])
    return dict(re.findall(r"(\w+)=(\S+)", out.stdout))


def _on_login_node(
    cluster: SlurmLab, args: list[str], cwd: Path, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        cluster.command(args),
        cwd=cwd,
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _sweep_folder(root: Path) -> Path:
    (sweep,) = [p for p in (root / "multirun").glob("*/*") if p.is_dir()]
    return sweep


@pytest.mark.slow
def test_launcher_slurm_trains_one_job_across_two_lab_nodes(
    cluster: SlurmLab, tmp_path: Path
) -> None:
    done = _on_login_node(
        cluster, [PYTHON, TRAIN, "-m", "launcher=slurm", *TWO_NODES, *FAST], tmp_path
    )
    assert done.returncode == 0, done.stderr[-4000:]
    sweep = _sweep_folder(tmp_path)
    record = results(sweep / "0")
    assert record["world_size"] == 2 and record["num_nodes"] == 2
    assert record["devices_per_node"] == 1
    # Each rank on its own node: its own hostname and its node's link address.
    assert [n["hostname"] for n in record["nodes"]] == cluster.hostnames
    assert [n["address"] for n in record["nodes"]] == [n.address for n in cluster.lab.nodes]
    (script,) = (sweep / ".submitit").glob("*/*_submission.sh")
    text = script.read_text()
    assert "--nodes=2" in text and "--ntasks-per-node=1" in text and "gpu" not in text


@pytest.mark.slow
def test_sbatch_of_a_plain_srun_trains_one_job_across_two_lab_nodes(
    cluster: SlurmLab, tmp_path: Path
) -> None:
    script = tmp_path / "job.sh"
    script.write_text(
        "#!/bin/bash\n"
        "#SBATCH --nodes=2 --ntasks-per-node=1 --output=job.out\n"
        f"srun {PYTHON} {TRAIN} {' '.join([*TWO_NODES, *FAST])}\n"
    )
    done = _on_login_node(cluster, ["sbatch", "--parsable", "--wait", str(script)], tmp_path)
    log = (tmp_path / "job.out").read_text() if (tmp_path / "job.out").exists() else ""
    assert done.returncode == 0, (done.stderr + log)[-4000:]
    job_id = done.stdout.split()[0].split(";")[0]
    record = results(tmp_path / "outputs" / "slurm" / f"{job_id}.0")
    assert record["world_size"] == 2 and record["num_nodes"] == 2
    assert [n["hostname"] for n in record["nodes"]] == cluster.hostnames


# The preemption runs: 20 steps per epoch on each of the 2 ranks, 3 epochs (those of
# tests/test_slurm.py, one rank per node instead of two on one node).
PREEMPT_RUN = [
    "strategy=ddp",
    "data=synthetic",
    "data.num_samples=1280",
    "data.eval_samples=32",
    "data.image_size=8",
    "data.batch_size=32",
    "trainer.max_epochs=3",
    "trainer.limit_val_batches=1",
    "trainer.limit_test_batches=1",
    "trainer.num_sanity_val_steps=0",
    "trainer.enable_model_summary=false",
    "logger=none",
    "+callbacks.step_probe._target_=slurm_probe.StepProbe",
    # The watchdog's stack dump must leave the preemption signal to its owner.
    "debug=watchdog",
]
STEPS_PER_EPOCH = 20
SIGNAL_AT_STEP = 30  # epoch 1, batch 10: the preemption signal, to node 1's task only
TERM_AT_STEP = 45  # epoch 2, batch 5: `scontrol requeue`, SIGTERM to every task


def _task_on_node(job_id: str, node: int, hostname: str) -> int:
    """The process of the job's task on lab node `node` (all nodes share this machine's
    process table; the task's environment says where SLURM started it)."""
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURM_NODEID") == str(node)
            and env.get("SLURMD_NODENAME") == hostname
            and (proc.info["name"] or "").startswith("python")
            and "submitit.core._submit" in " ".join(proc.info["cmdline"] or [])
        ):
            return proc.pid
    raise AssertionError(f"no task of job {job_id} on node {node} ({hostname}) found")


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_a_preemption_of_one_node_saves_requeues_and_resumes_on_both(
    cluster: SlurmLab, tmp_path: Path
) -> None:
    """The preemption signal to node 1's task only, mid-epoch: both nodes save last.ckpt at
    the same step, the job requeues itself, waits SLURM's real begin time and resumes on
    both nodes in the same folder; then the scheduler requeues it (`scontrol requeue`:
    SIGTERM to every task): saved again, resumed again. The job ends with the weights of an
    uninterrupted run of world size 2, and the sweep process exits 0."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "plain").mkdir()
    queued = subprocess.Popen(
        cluster.command([PYTHON, TRAIN, "-m", "launcher=slurm", *PREEMPT_RUN, *TWO_NODES[1:]]),
        cwd=tmp_path / "slurm",
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    # The reference, uninterrupted (two ranks on this machine), alongside the whole job: on
    # a loaded machine, started only after the second requeue it outlasted its timeout.
    plain_err = tmp_path / "plain" / "stderr.txt"
    with plain_err.open("w") as err:
        plain = subprocess.Popen(
            [PYTHON, TRAIN, *PREEMPT_RUN, "devices=2", "accelerator=cpu", "hydra.run.dir=run"],
            cwd=tmp_path / "plain",
            env=subprocess_env(),
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    job_id = None
    try:
        job = wait_for_step(queued, tmp_path / "slurm", SIGNAL_AT_STEP, seconds=900)
        job_id = next((_sweep_folder(tmp_path / "slurm") / ".submitit").glob("[0-9]*")).name
        signalled = time.time()
        os.kill(_task_on_node(job_id, 1, cluster.hostnames[1]), signal.SIGUSR2)
        # The requeued job waits for its begin time (cred_expire + 1 s: 11 s here, 121 s
        # by default) after every task exited.
        wait_until(lambda: _job_state(cluster, job_id).get("JobState") == "PENDING", 120)
        pending = time.time()
        trained_again = wait_for_training_again(job, queued, seconds=900)
        wait_for_step(queued, tmp_path / "slurm", TERM_AT_STEP, seconds=900)
        requeued = cluster.run(["scontrol", "requeue", job_id])
        assert requeued.returncode == 0, requeued.stderr
        output, _ = queued.communicate(timeout=1500)
        plain.wait(timeout=1500)
    finally:
        for proc in (queued, plain):
            if proc.poll() is None:
                proc.kill()
        if job_id is not None:
            cluster.run(["scancel", job_id])
    assert queued.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert plain.returncode == 0, plain_err.read_text()[-3000:]
    record = results(job)
    assert record["requeues"] == 2 and record["resumed_from"] == str(
        job / "checkpoints" / "last.ckpt"
    )
    assert [n["hostname"] for n in record["nodes"]] == cluster.hostnames
    logs = job_logs(job)
    # Node 0's task never got the signal: it names SIGUSR2 because the ranks agreed on
    # node 1's, and saved once for both.
    by_node_1 = re.findall(
        r"Preempted \(SIGUSR2\): saved .* at step (\d+) \(epoch 1, batch (\d+)\); requeued", logs
    )
    by_scheduler = re.findall(
        r"Preempted \(SIGTERM\): saved .* at step (\d+) \(epoch 2, batch (\d+)\)", logs
    )
    assert len(by_node_1) == 1 and len(by_scheduler) == 1, logs[-3000:]
    first_save, second_save = int(by_node_1[0][0]), int(by_scheduler[0][0])
    assert SIGNAL_AT_STEP <= first_save < 2 * STEPS_PER_EPOCH
    assert 0 < int(by_node_1[0][1]) < STEPS_PER_EPOCH
    assert TERM_AT_STEP <= second_save < 3 * STEPS_PER_EPOCH
    first, second, third = record["attempts"]
    assert first["began"] == "fresh" and first["start_step"] == 0
    assert second["began"] == "requeue" and second["start_step"] == first_save
    assert third["began"] == "requeue" and third["start_step"] == second_save
    assert all(a["world_size"] == 2 for a in record["attempts"])
    assert record["global_step"] == 3 * STEPS_PER_EPOCH
    mine = torch.load(job / "model.pt", weights_only=True)
    reference = torch.load(tmp_path / "plain" / "run" / "model.pt", weights_only=True)
    print(
        f"signal -> pending {pending - signalled:.1f} s; signal -> training again "
        f"{trained_again - signalled:.1f} s (with the begin-time wait); saved at steps "
        f"{first_save} (SIGUSR2 to node 1) and {second_save} (scontrol requeue)"
    )
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)


@pytest.mark.slow
def test_a_node_list_naming_a_host_the_lab_lacks_is_refused_before_queueing(
    cluster: SlurmLab, tmp_path: Path
) -> None:
    nodelist = "+hydra.launcher.additional_parameters.nodelist='sl-node[0,7]'"
    proc = _on_login_node(
        cluster, [PYTHON, TRAIN, "-m", "launcher=slurm", *TWO_NODES, *FAST, nodelist], tmp_path
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (paragraph,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert (
        "hydra.launcher.additional_parameters.nodelist='sl-node[0,7]' is not valid: nodes "
        "of the default partition: sl-node0, sl-node1 (sinfo); it has no sl-node7" in paragraph
    )
    assert "Fix: name nodes that sinfo lists" in paragraph
    assert "Traceback" not in proc.stderr
    assert not _queued(cluster) and not (tmp_path / "multirun").exists()
    # sbatch itself refuses it too (one line, its own), and queues nothing.
    plain = cluster.run(["sbatch", "--nodelist=sl-node7", "--wrap=true", "--output=/dev/null"])
    assert plain.returncode != 0 and "Invalid node name specified" in plain.stderr
    assert not _queued(cluster)


@pytest.mark.slow
def test_more_nodes_than_the_partition_has_are_refused_before_queueing(
    cluster: SlurmLab, tmp_path: Path
) -> None:
    proc = _on_login_node(
        cluster,
        [PYTHON, TRAIN, "-m", "launcher=slurm", "strategy=ddp", "num_nodes=3", "devices=1", *FAST],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (paragraph,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert "num_nodes=3 is not valid: at most the 2 nodes of the default partition" in paragraph
    assert "Traceback" not in proc.stderr
    assert not _queued(cluster) and not (tmp_path / "multirun").exists()
    # A plain sbatch of more nodes than the partition has is refused at submission (the
    # lab enforces partition limits), instead of pending forever.
    plain = cluster.run(["sbatch", "--nodes=3", "--wrap=true", "--output=/dev/null"])
    assert plain.returncode != 0 and "Batch job submission failed" in plain.stderr
    assert not _queued(cluster)


@pytest.mark.slow
def test_a_job_sbatch_refuses_ends_the_sweep_in_one_paragraph(
    cluster: SlurmLab, tmp_path: Path
) -> None:
    """A refusal no check foresees (a feature no node has): sbatch's own line, then the
    project's paragraph, exit code 2, no traceback, nothing queued."""
    proc = _on_login_node(
        cluster,
        [
            PYTHON,
            TRAIN,
            "-m",
            "launcher=slurm",
            *TWO_NODES,
            *FAST,
            "hydra.launcher.constraint=a100",
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    (paragraph,) = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert paragraph.startswith(
        "error: sbatch refused the sweep's job, nothing was queued: sbatch: error: Batch job "
        "submission failed: Invalid feature specification. Fix: change the launcher setting"
    )
    assert "Traceback" not in proc.stderr
    assert not _queued(cluster)
    assert not list(tmp_path.glob("multirun/*/*/0"))
