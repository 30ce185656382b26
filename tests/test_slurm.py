"""`launcher=slurm` against a real SLURM scheduler (scripts/slurm_local.sh start): DDP jobs
of two srun tasks, a sweep, preemption that saves, requeues and resumes, and submissions the
cluster cannot run, refused before anything is queued."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    FAST,
    FIRST_EPOCH_STEPS,
    ROOT,
    TESTS,
    TWO_EPOCHS,
    interrupt_after_first_epoch,
    results,
    train,
)

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
    if out.returncode != 0 or not {"idle", "mixed", "allocated"} & set(states):
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
SIGNAL_AT_STEP = 30  # epoch 1, batch 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_preempted_job_saves_requeues_and_resumes_exactly(slurm, tmp_path: Path) -> None:
    """`scancel --signal=USR2` (what SLURM sends before the time limit, and a preemption)
    mid-epoch: every rank saves last.ckpt at the next step, the job requeues itself into the
    same folder, resumes there and finishes with the weights of an uninterrupted run."""
    (tmp_path / "slurm").mkdir()
    (tmp_path / "plain").mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    command = [sys.executable, str(ROOT / "train.py")]
    queued = subprocess.Popen(
        [command[0], command[1], "-m", "launcher=slurm", *PREEMPT_RUN],
        cwd=tmp_path / "slurm",
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    job_id = None
    try:
        job = _wait_for_step(queued, tmp_path / "slurm", SIGNAL_AT_STEP)
        job_id = next((_sweep_folder(tmp_path / "slurm") / ".submitit").glob("[0-9]*")).name
        signalled = time.time()
        subprocess.run(["scancel", "--signal=USR2", job_id], check=True)
        # A requeued job waits for its begin time (cred_expire + 1 s, 121 s by default).
        _wait_until(lambda: _job_state(job_id).get("JobState") == "PENDING", 120)
        pending = time.time()
        subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=True)
        trained_again = _wait_for_training_again(job, queued)
        # The reference, uninterrupted, while the requeued job trains.
        plain = train(*PREEMPT_RUN, "hydra.run.dir=run", cwd=tmp_path / "plain", timeout=500)
        output, _ = queued.communicate(timeout=500)
    finally:
        if queued.poll() is None:
            queued.kill()
        if job_id is not None:
            subprocess.run(["scancel", job_id], check=False)
    assert queued.returncode == 0, output[-4000:]
    assert plain.returncode == 0
    record = results(job)
    assert record["requeues"] == 1 and record["resumed_from"] == str(
        job / "checkpoints" / "last.ckpt"
    )
    first, requeued = record["attempts"]
    assert first["began"] == "fresh" and first["start_step"] == 0
    assert requeued["began"] == "requeue" and requeued["start_step"] > 0
    saved = re.search(
        r"Preempted \(SIGUSR2\): saved .* at step (\d+) \(epoch 1, batch (\d+)\)", _job_logs(job)
    )
    assert saved, _job_logs(job)[-3000:]
    assert SIGNAL_AT_STEP <= int(saved.group(1)) < 2 * STEPS_PER_EPOCH
    assert 0 < int(saved.group(2)) < STEPS_PER_EPOCH
    assert record["global_step"] == 3 * STEPS_PER_EPOCH
    mine = torch.load(job / "model.pt", weights_only=True)
    reference = torch.load(tmp_path / "plain" / "run" / "model.pt", weights_only=True)
    print(
        f"signal -> pending {pending - signalled:.1f} s; signal -> training again "
        f"{trained_again - signalled:.1f} s (without the begin-time wait)"
    )
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)


def _job_logs(job: Path) -> str:
    submitit = job.parent / ".submitit"
    return "".join(p.read_text(errors="replace") for p in sorted(submitit.glob("*/*_0_log.err")))


def _wait_until(condition, seconds: float) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def _wait_for_step(proc: subprocess.Popen, root: Path, step: int) -> Path:
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "the job did not reach the step"
        files = list(root.glob("multirun/*/*/0/step"))
        if files and int(files[0].read_text().split()[0]) >= step:
            return files[0].parent
        time.sleep(0.1)


def _wait_for_training_again(job: Path, proc: subprocess.Popen) -> float:
    """When rank 0 of the requeued job finishes a step after the resumed one."""
    resumed = int((job / "step").read_text().split()[0])
    deadline = time.time() + 300
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "the requeued job did not train again"
        step, at = (job / "step").read_text().split()
        if int(step) != resumed:
            return float(at)
        time.sleep(0.1)


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
