"""`launcher=slurm`'s launcher: hydra-submitit-launcher's, with a job that ended without a
result (preempted and not requeued, killed, out of time) reported in a few lines taken from
its log instead of submitit's traceback. Hydra imports every module of this namespace at
start-up, so this one stays light (submitit is imported when a sweep launches)."""

from __future__ import annotations

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

            try:
                return super().launch(job_overrides, initial_job_idx)
            except UncompletedJobError as ended:
                print(f"error: {ended_without_result(str(ended))}", file=sys.stderr, flush=True)
                sys.exit(1)


def ended_without_result(submitit_message: str) -> str:
    """submitit's message (`Job 17 (task: 0) ... has not produced any output (state:
    FAILED)`, then the task's whole log) cut to its first line and what the job said."""
    lines = submitit_message.splitlines()
    head, log = " ".join(" ".join(lines[:2]).split()), lines[2:]
    told = [line.strip() for line in log if line.strip().startswith(TOLD)]
    said = told or [line for line in log if line.strip()][-5:]
    return f"{head}; the job's log says:\n" + "\n".join(said)
