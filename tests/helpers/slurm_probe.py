"""Callbacks the SLURM and signal tests add from the command line, e.g.
`+callbacks.step_probe._target_=slurm_probe.StepProbe`: rank 0 writes the step it finished
to `<job>/step` (so that a test can signal a job mid-epoch), each step lasting at least
`step_s` seconds; and a failure injected at a step."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class StepProbe(L.Callback):
    def __init__(self, step_s: float = 0.05) -> None:
        self.step_s = step_s
        self._started = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._started = time.monotonic()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        time.sleep(max(0.0, self.step_s - (time.monotonic() - self._started)))
        if trainer.is_global_zero:
            step = Path(trainer.default_root_dir) / "step"
            step.with_suffix(".tmp").write_text(f"{trainer.global_step} {time.time()}")
            step.with_suffix(".tmp").replace(step)


class FailAtStep(L.Callback):
    """Raises in training step `step` when `fail` is true (a sweep sets it per job)."""

    def __init__(self, fail: bool = True, step: int = 1) -> None:
        self.fail = fail
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if self.fail and trainer.global_step == self.step:
            raise RuntimeError(f"injected failure at step {self.step}")
