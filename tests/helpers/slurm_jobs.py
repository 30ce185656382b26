"""Following a SLURM job of the tests (one machine's cluster or the lab's): the step its
rank 0 reached (written by `slurm_probe.StepProbe`), and its tasks' logs."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_until(condition, seconds: float) -> None:
    deadline = time.time() + seconds
    while not condition():
        assert time.time() < deadline, "timed out"
        time.sleep(0.2)


def wait_for_step(proc: subprocess.Popen, root: Path, step: int, seconds: float = 300) -> Path:
    """The job's folder, once its rank 0 finished training step `step`."""
    deadline = time.time() + seconds
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "the job did not reach the step"
        files = list(root.glob("multirun/*/*/0/step"))
        if files and int(files[0].read_text().split()[0]) >= step:
            return files[0].parent
        time.sleep(0.1)


def wait_for_training_again(job: Path, proc: subprocess.Popen, seconds: float = 300) -> float:
    """When rank 0 of the requeued job finishes a step after the resumed one."""
    resumed = int((job / "step").read_text().split()[0])
    deadline = time.time() + seconds
    while True:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        assert time.time() < deadline, "the requeued job did not train again"
        step, at = (job / "step").read_text().split()
        if int(step) != resumed:
            return float(at)
        time.sleep(0.1)


def job_logs(job: Path, tasks: str = "*") -> str:
    """The stderr of the job's tasks (`tasks="0"`: the first task's), every attempt."""
    submitit = job.parent / ".submitit"
    pattern = f"*/*_{tasks}_log.err" if tasks != "*" else "*/*_log.err"
    return "".join(p.read_text(errors="replace") for p in sorted(submitit.glob(pattern)))
