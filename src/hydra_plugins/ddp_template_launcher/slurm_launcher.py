"""`launcher=slurm`'s launcher: hydra-submitit-launcher's, with a job that ended without a
result (preempted and not requeued, killed, out of time) reported in a few lines taken from
its log instead of submitit's traceback, and seen to end on a cluster without accounting
storage too. Hydra imports every module of this namespace at start-up, so this one stays
light (submitit is imported when a sweep launches)."""

from __future__ import annotations

import functools
import re
import subprocess
import sys
from collections.abc import Sequence

from hydra.core.utils import JobReturn

try:
    from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher
except ImportError:  # without the `cluster` extra; launcher=slurm is refused (plugins.py)
    SlurmLauncher = None

# The lines of a job's log that say why it ended: this project's own messages.
TOLD = ("Preempted (", "error:")


if SlurmLauncher is not None:

    class ReportingSlurmLauncher(SlurmLauncher):
        def launch(
            self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
        ) -> Sequence[JobReturn]:
            from submitit.core.utils import UncompletedJobError
            from submitit.slurm.slurm import SlurmJob

            watcher = _watcher_with_fallback()
            if not isinstance(SlurmJob.watcher, watcher):
                SlurmJob.watcher = watcher(delay_s=60)
            try:
                return super().launch(job_overrides, initial_job_idx)
            except UncompletedJobError as ended:
                refused = submission_refused(ended)
                if refused is not None:
                    print(f"error: {refused}", file=sys.stderr, flush=True)
                    sys.exit(2)
                print(f"error: {ended_without_result(str(ended))}", file=sys.stderr, flush=True)
                sys.exit(1)


def submission_refused(ended: BaseException) -> str | None:
    """One paragraph for a job sbatch refused (submitit raises the error of the sbatch
    command as a failed job), or None for a job that ran and ended without a result."""
    cause = ended.__cause__
    if not isinstance(cause, subprocess.CalledProcessError):
        return None
    command = cause.cmd if isinstance(cause.cmd, (list, tuple)) else str(cause.cmd).split()
    if not command or not str(command[0]).endswith("sbatch"):
        return None
    said = " ".join(str(cause.stderr or ended).split())
    return (
        f"sbatch refused the sweep's job, nothing was queued: {said}. Fix: change the "
        "launcher setting it names (hydra.launcher.*, see conf/launcher/slurm.yaml) to what "
        "the cluster offers (sinfo, scontrol show partition)"
    )


def ended_without_result(submitit_message: str) -> str:
    """submitit's message (`Job 17 (task: 0) ... has not produced any output (state:
    FAILED)`, then the task's whole log) cut to its first line and what the job said."""
    lines = submitit_message.splitlines()
    head, log = " ".join(" ".join(lines[:2]).split()), lines[2:]
    told = [line.strip() for line in log if line.strip().startswith(TOLD)]
    said = told or [line for line in log if line.strip()][-5:]
    return f"{head}; the job's log says:\n" + "\n".join(said)


@functools.cache
def _watcher_with_fallback() -> type:
    from submitit.slurm.slurm import SlurmInfoWatcher

    class StatesFromSlurmctld(SlurmInfoWatcher):
        """submitit's watcher asks `sacct`; a cluster without accounting storage (no
        slurmdbd, as many small ones) answers nothing, so a job that ended without a result
        file stayed "UNKNOWN" and the sweep waited forever. The jobs sacct does not know
        are asked of slurmctld (`scontrol show job`) instead."""

        def __init__(self, delay_s: int = 60) -> None:
            super().__init__(delay_s)
            self._asked_slurmctld: set[str] = set()

        def update(self) -> None:
            super().update()
            missing = {
                job
                for job in self._registered - self._finished
                if job not in self._info_dict or job in self._asked_slurmctld
            }
            if not missing:
                return
            states = slurmctld_states(missing)
            self._info_dict.update(states)
            self._asked_slurmctld |= set(states)
            for job in missing:
                if self.is_done(job, mode="cache"):
                    self._finished.add(job)

    return StatesFromSlurmctld


def slurmctld_states(jobs: set[str]) -> dict[str, dict[str, str]]:
    """`{job: {"JobID", "State"}}` for submitit's ids (`18`, or `18_0` for an array task)
    from `scontrol show job`; a job slurmctld no longer knows (ended more than MinJobAge
    ago) is "ENDED"."""
    states: dict[str, dict[str, str]] = {}
    for base in sorted({job.split("_")[0] for job in jobs}):
        out = subprocess.run(
            ["scontrol", "show", "job", "--oneliner", base],
            capture_output=True,
            text=True,
            timeout=60,
        )
        if out.returncode != 0:
            if "Invalid job id" in out.stderr:
                states.update(
                    {
                        job: {"JobID": job, "State": "ENDED"}
                        for job in jobs
                        if job.split("_")[0] == base
                    }
                )
            continue
        for line in out.stdout.splitlines():
            fields = dict(re.findall(r"(\w+)=(\S*)", line))
            task = fields.get("ArrayTaskId")
            job = f"{fields.get('ArrayJobId')}_{task}" if task else fields.get("JobId", "")
            states[job] = {"JobID": job, "State": fields.get("JobState", "UNKNOWN")}
    return {job: state for job, state in states.items() if job in jobs}
