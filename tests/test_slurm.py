"""`launcher=slurm` against a real SLURM scheduler (scripts/slurm_local.sh start): DDP jobs
of two srun tasks, a sweep, preemption that saves, requeues and resumes, and submissions the
cluster cannot run, refused before anything is queued."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from helpers.runs import (
    FAST,
    FIRST_EPOCH_STEPS,
    HELPERS,
    ROOT,
    TWO_EPOCHS,
    interrupt_after_first_epoch,
    results,
    train,
)
from helpers.slurm_jobs import job_logs, wait_for_step, wait_for_training_again, wait_until

# One SLURM and one lab at a time: under pytest-xdist (README's test command) the tests of
# this group run in one worker, one after another (their clusters share names, addresses
# and the one-machine SLURM's CPUs).
pytestmark = pytest.mark.xdist_group("cluster")

# Two tasks of one CPU each, a few steps: a DDP job of a few seconds once started.
TINY_SLURM = ["-m", "launcher=slurm", "strategy=ddp", "devices=2", *FAST]


def _node_cpus() -> list[int]:
    out = subprocess.run(
        ["sinfo", "--noheader", "--Node", "--format=%c|%T"], capture_output=True, text=True
    )
    return [int(line.split("|")[0]) for line in out.stdout.splitlines() if "|" in line]


@pytest.fixture
def slurm() -> None:
    """A running scheduler with a usable node, or a skip that says how to get one."""
    how = "start one as root: bash scripts/slurm_local.sh start"
    if shutil.which("sinfo") is None:
        pytest.skip(f"SLURM is not installed here ({how})")
    out = subprocess.run(
        ["sinfo", "--noheader", "--format=%T"], capture_output=True, text=True, timeout=30
    )
    states = out.stdout.split()
    if out.returncode != 0 or not {"idle", "mixed", "allocated", "completing"} & set(states):
        pytest.skip(f"no SLURM scheduler with a usable node is running ({how}): {out.stderr}")
    if min(_node_cpus()) < 2:
        pytest.skip("the SLURM node has fewer than 2 CPUs, and these jobs run 2 tasks")


def _queued_jobs() -> set[str]:
    out = subprocess.run(["squeue", "--noheader", "--format=%i"], capture_output=True, text=True)
    return set(out.stdout.split())


def _sweep_folder(root: Path) -> Path:
    (sweep,) = [p for p in (root / "multirun").glob("*/*") if p.is_dir()]
    return sweep


def _job_state(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", job_id], capture_output=True, text=True)
    return dict(re.findall(r"(\w+)=(\S+)", out.stdout))


@pytest.mark.slow
def test_sweep_runs_one_two_task_ddp_job_per_value(slurm, tmp_path: Path) -> None:
    train(*TINY_SLURM, "strategy.bucket_cap_mb=25,50", cwd=tmp_path, timeout=500)
    sweep = _sweep_folder(tmp_path)
    jobs = sorted(p for p in sweep.iterdir() if p.name.isdigit())
    assert [p.name for p in jobs] == ["0", "1"]
    for job, bucket in zip(jobs, (25, 50), strict=True):
        record = results(job)
        assert record["world_size"] == 2 and record["num_nodes"] == 1
        assert record["ddp"]["bucket_cap_mb"] == bucket
    # Two SLURM jobs (an array), two tasks each, and no GPU asked of the CPU partition.
    scripts = list((sweep / ".submitit").glob("*/*_submission.sh"))
    assert len({s.parent.name for s in (sweep / ".submitit").glob("*_*/*_0_log.out")}) == 2
    text = scripts[0].read_text()
    assert "--ntasks-per-node=2" in text and "gpu" not in text


# The preemption runs: 20 steps per epoch on each of the 2 ranks, 3 epochs.
PREEMPT_RUN = [
    "strategy=ddp",
    "devices=2",
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
SIGNAL_AT_STEP = 30  # epoch 1, batch 10: the preemption signal, to rank 1 only
TERM_AT_STEP = 45  # epoch 2, batch 5: `scontrol requeue`, SIGTERM to every rank


def _env() -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HELPERS), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }


def _sweep(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(ROOT / "train.py"), "-m", "launcher=slurm", *args],
        cwd=cwd,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _rank_pid(job_id: str, rank: int) -> int:
    """The process of one task of a running SLURM job (srun's tasks run here)."""
    for proc in psutil.process_iter(["name", "cmdline"]):
        try:
            env = proc.environ()
        except (psutil.AccessDenied, psutil.NoSuchProcess):
            continue
        if (
            env.get("SLURM_JOB_ID") == job_id
            and env.get("SLURM_PROCID") == str(rank)
            and (proc.info["name"] or "").startswith("python")
            and "submitit.core._submit" in " ".join(proc.info["cmdline"] or [])
        ):
            return proc.pid
    raise AssertionError(f"no task of rank {rank} of job {job_id} found")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_preempted_job_saves_requeues_and_resumes_exactly(slurm, tmp_path: Path) -> None:
    """The preemption signal to ONE rank mid-epoch: both ranks save last.ckpt at the same
    step, the job requeues itself, waits SLURM's real begin time and resumes in the same
    folder; later the scheduler requeues it (`scontrol requeue`: SIGTERM to every rank):
    saved again, resumed again. The job ends with the weights of an uninterrupted run and
    the sweep process exits 0 (it polled the job through both waits)."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "plain").mkdir()
    queued = _sweep(PREEMPT_RUN, tmp_path / "slurm")
    job_id = None
    try:
        job = wait_for_step(queued, tmp_path / "slurm", SIGNAL_AT_STEP)
        job_id = next((_sweep_folder(tmp_path / "slurm") / ".submitit").glob("[0-9]*")).name
        signalled = time.time()
        os.kill(_rank_pid(job_id, 1), signal.SIGUSR2)
        # The requeued job waits for its begin time (cred_expire + 1 s: 11 s here, 121 s
        # by default) after every task exited.
        wait_until(lambda: _job_state(job_id).get("JobState") == "PENDING", 120)
        pending = time.time()
        trained_again = wait_for_training_again(job, queued)
        wait_for_step(queued, tmp_path / "slurm", TERM_AT_STEP)
        subprocess.run(["scontrol", "requeue", job_id], check=True)
        # The reference, uninterrupted, while the job waits and resumes.
        plain = train(*PREEMPT_RUN, "hydra.run.dir=run", cwd=tmp_path / "plain", timeout=500)
        output, _ = queued.communicate(timeout=500)
    finally:
        if queued.poll() is None:
            queued.kill()
        if job_id is not None:
            subprocess.run(["scancel", job_id], check=False)
    assert queued.returncode == 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert plain.returncode == 0
    record = results(job)
    assert record["requeues"] == 2 and record["resumed_from"] == str(
        job / "checkpoints" / "last.ckpt"
    )
    logs = job_logs(job, tasks="0")
    # Rank 0 never got the signal: it names SIGUSR2 because the ranks agreed on rank 1's.
    by_rank_1 = re.search(
        r"Preempted \(SIGUSR2\): saved .* at step (\d+) \(epoch 1, batch (\d+)\); requeued", logs
    )
    by_scheduler = re.search(
        r"Preempted \(SIGTERM\): saved .* at step (\d+) \(epoch 2, batch (\d+)\)", logs
    )
    assert by_rank_1 and by_scheduler, logs[-3000:]
    first_save, second_save = int(by_rank_1.group(1)), int(by_scheduler.group(1))
    assert SIGNAL_AT_STEP <= first_save < 2 * STEPS_PER_EPOCH
    assert 0 < int(by_rank_1.group(2)) < STEPS_PER_EPOCH
    assert TERM_AT_STEP <= second_save < 3 * STEPS_PER_EPOCH
    first, second, third = record["attempts"]
    assert first["began"] == "fresh" and first["start_step"] == 0
    assert second["began"] == "requeue" and second["start_step"] == first_save
    assert third["began"] == "requeue" and third["start_step"] == second_save
    assert record["global_step"] == 3 * STEPS_PER_EPOCH
    mine = torch.load(job / "model.pt", weights_only=True)
    reference = torch.load(tmp_path / "plain" / "run" / "model.pt", weights_only=True)
    print(
        f"signal -> pending {pending - signalled:.1f} s; signal -> training again "
        f"{trained_again - signalled:.1f} s (with the begin-time wait)"
    )
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_job_that_cannot_requeue_ends_with_the_command_that_resumes_it(
    slurm, tmp_path: Path
) -> None:
    """A job submitted without requeue (`sbatch --no-requeue`): at the preemption signal it
    saves, `scontrol requeue` is refused, and the sweep ends non-zero with the checkpoint
    and the command that resumes from it, without a traceback; that command, run, finishes
    the job with the weights of an uninterrupted run."""
    run = [*PREEMPT_RUN, "trainer.max_epochs=2"]
    (tmp_path / "slurm").mkdir()
    (tmp_path / "plain").mkdir()
    queued = _sweep(
        [*run, "+hydra.launcher.additional_parameters.no_requeue=true"], tmp_path / "slurm"
    )
    job_id = None
    try:
        job = wait_for_step(queued, tmp_path / "slurm", 5)
        job_id = next((_sweep_folder(tmp_path / "slurm") / ".submitit").glob("[0-9]*")).name
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        plain = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *run, "hydra.run.dir=run"],
            cwd=tmp_path / "plain",
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        output, _ = queued.communicate(timeout=300)
    finally:
        if queued.poll() is None:
            queued.kill()
        if job_id is not None:
            subprocess.run(["scancel", job_id], check=False)
    last = job / "checkpoints" / "last.ckpt"
    assert queued.returncode != 0, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    (line,) = [x for x in output.splitlines() if "resume with: " in x]
    assert f"saved {last} at step" in line and "requeueing SLURM job" in line, line
    assert _job_state(job_id).get("JobState") == "FAILED"
    command = line.split("resume with: ", 1)[1]
    # The same sweep, continued in its folder: this job resumes there.
    assert command.endswith(f"hydra.sweep.dir={job.parent} resume=true") and " -m " in command
    resumed = subprocess.run(
        ["bash", "-c", command], env=_env(), capture_output=True, text=True, timeout=500
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert plain.wait(timeout=500) == 0, plain.stderr.read()[-3000:]
    finished = job
    record = results(finished)
    first, again = record["attempts"]
    assert first["began"] == "fresh" and first["start_step"] == 0
    assert again["began"] == "resume" and again["start_step"] >= 5
    assert record["global_step"] == 2 * STEPS_PER_EPOCH
    mine = torch.load(finished / "model.pt", weights_only=True)
    reference = torch.load(tmp_path / "plain" / "run" / "model.pt", weights_only=True)
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)


def test_a_partition_that_does_not_exist_is_refused_before_queueing(slurm, tmp_path) -> None:
    before = _queued_jobs()
    proc = train(*TINY_SLURM, "hydra.launcher.partition=nosuch", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "hydra.launcher.partition='nosuch' is not valid" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Nothing new queued (a job of an earlier test may finish meanwhile).
    assert _queued_jobs() <= before and not (tmp_path / "multirun").exists()


def test_more_devices_than_cpus_of_any_node_is_refused_before_queueing(slurm, tmp_path) -> None:
    too_many = max(_node_cpus()) + 1
    before = _queued_jobs()
    args = [a for a in TINY_SLURM if a != "devices=2"]
    proc = train(*args, f"devices={too_many}", cwd=tmp_path, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"devices={too_many} is not valid" in proc.stderr and "CPUs" in proc.stderr
    assert "Traceback" not in proc.stderr
    # Nothing new queued (a job of an earlier test may finish meanwhile).
    assert _queued_jobs() <= before and not (tmp_path / "multirun").exists()


def test_a_sweep_over_devices_is_refused(slurm, tmp_path) -> None:
    args = [a for a in TINY_SLURM if a != "devices=2"]
    proc = train(*args, "devices=1,2", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "one value per sweep" in proc.stderr, proc.stderr[-3000:]
    assert not (tmp_path / "multirun").exists()


@pytest.mark.slow
def test_a_resumed_sweep_runs_only_what_is_missing(slurm, tmp_path: Path) -> None:
    """resume=true: the finished job's results stay as they were, the interrupted one
    continues from its last.ckpt in its SLURM job."""
    sweep = tmp_path / "sweep"
    command = ["-m", "launcher=slurm", *TWO_EPOCHS, "seed=1,2", f"hydra.sweep.dir={sweep}"]
    train(*command, cwd=tmp_path)
    finished = (sweep / "0" / "results.json").stat().st_mtime_ns
    interrupt_after_first_epoch(sweep / "1")

    train(*command, "resume=true", cwd=tmp_path)
    assert (sweep / "0" / "results.json").stat().st_mtime_ns == finished
    attempts = results(sweep / "1")["attempts"]
    assert [(a["began"], a["start_step"]) for a in attempts] == [
        ("fresh", 0),
        ("resume", FIRST_EPOCH_STEPS),
    ]


@pytest.mark.slow
def test_launcher_slurm_without_multirun_is_refused(tmp_path) -> None:
    """Without -m Hydra ignores the launcher and the run would train here, unnoticed."""
    proc = train("launcher=slurm", "strategy=ddp", "devices=2", cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "-m (--multirun)" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "outputs").exists()


def test_a_job_that_ended_without_a_result_is_told_by_its_own_lines() -> None:
    from hydra_plugins.ddp_template_launcher.slurm_launcher import ended_without_result

    said = "Preempted (SIGUSR2): saved /j/last.ckpt at step 5 (epoch 0, batch 5); resume with: x"
    submitit_message = "\n".join(
        [
            "Job 17 (task: 0) with path /j/17_0_result.pkl",
            "has not produced any output (state: FAILED)",
            "Error stream produced:",
            "-" * 40,
            "GPU available: False, used: False",
            said,
            "srun: error: vm: task 0: Exited with exit code 1",
        ]
    )
    assert ended_without_result(submitit_message) == (
        "Job 17 (task: 0) with path /j/17_0_result.pkl has not produced any output "
        f"(state: FAILED); the job's log says:\n{said}"
    )
    # Without a line of this project's, the end of the log.
    assert ended_without_result(submitit_message.replace(said, "")).endswith(
        "GPU available: False, used: False\nsrun: error: vm: task 0: Exited with exit code 1"
    )


def test_a_job_sacct_cannot_tell_of_is_asked_of_slurmctld(slurm) -> None:
    """Without accounting storage sacct knows no job: the state comes from slurmctld, and a
    job it no longer knows has ended (the sweep would otherwise wait for it forever)."""
    from hydra_plugins.ddp_template_launcher.slurm_launcher import slurmctld_states

    job = subprocess.run(
        ["sbatch", "--parsable", "--hold", "--wrap=true", "--output=/dev/null"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    try:
        assert slurmctld_states({job, "999999999"}) == {
            job: {"JobID": job, "State": "PENDING"},
            "999999999": {"JobID": "999999999", "State": "ENDED"},
        }
    finally:
        subprocess.run(["scancel", job], check=False)
