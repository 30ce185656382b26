"""The attempts a run took, carried in its checkpoints: results.json tells a resume from
a retrain.

Each attempt (the first start, a restart of the worker group, a SLURM requeue, `resume=true`,
a start from `ckpt_path`) notes when training starts how it began, the optimizer step it started at and
its world size, and in each checkpoint the training samples it had trained (all ranks).
The list travels inside every checkpoint (`AttemptLog`'s state), so the attempt that
finishes holds all of them: an attempt that resumed starts at a step > 0, one that ignored
its checkpoint at 0; and the samples of all attempts add up to what the final weights were
trained on (work after an attempt's last checkpoint is lost with it, and done again).
"""

from __future__ import annotations

import os
from typing import Any, cast

import lightning as L

from ddp_template.resume.loader import ResumableDataLoader


def restart_count() -> int:
    """Restarts of the worker group by the elastic agent (max_restarts)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def requeue_count() -> int:
    """Requeues of the SLURM job (preemption, time limit)."""
    return int(os.environ.get("SLURM_RESTART_COUNT", "0"))


def how_attempt_began(ckpt_path: object, resume: bool = False) -> str:
    """restart | requeue (whether or not a checkpoint was found) | resume (`resume=true`
    found the job's checkpoint) | ckpt_path | fresh."""
    if restart_count() > 0:
        return "restart"
    if requeue_count() > 0:
        return "requeue"
    if resume and ckpt_path:
        return "resume"
    return "ckpt_path" if ckpt_path else "fresh"


class AttemptLog(L.Callback):
    def __init__(self, resume: bool = False) -> None:
        # `resume=true`: an attempt that starts from a checkpoint began as a resume.
        self._resume = resume
        self._earlier: list[dict[str, Any]] = []
        self._current: dict[str, Any] | None = None
        self._trainer: L.Trainer | None = None

    @property
    def state_key(self) -> str:
        return type(self).__name__

    @property
    def attempts(self) -> list[dict[str, Any]]:
        if self._current is None:
            return list(self._earlier)
        loader = self._trainer.train_dataloader if self._trainer else None
        if isinstance(loader, ResumableDataLoader):
            self._current["samples_trained"] = loader.samples_trained
        return [*self._earlier, self._current]

    @property
    def samples_trained(self) -> int | None:
        """All attempts together, all ranks (None when an attempt's loader did not count)."""
        counts = [attempt.get("samples_trained") for attempt in self.attempts]
        return None if not counts or None in counts else sum(cast(list[int], counts))

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._trainer = trainer
        self._current = {
            "began": how_attempt_began(trainer.ckpt_path, self._resume),
            "start_step": trainer.global_step,
            "world_size": trainer.world_size,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"attempts": self.attempts}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Only the checkpoint an attempt resumes from tells its history: the test after
        # training loads best.ckpt too, whose list already holds this attempt.
        if self._current is None:
            self._earlier = list(state_dict.get("attempts", []))


def attempts_summary(trainer: L.Trainer) -> dict[str, Any]:
    """`attempts`: how each began, its first step, world size and samples trained
    ; `samples_trained`: theirs together, all ranks."""
    logs = [c for c in trainer.callbacks if isinstance(c, AttemptLog)]  # type: ignore[attr-defined]
    if not logs:
        return {"attempts": [], "samples_trained": None}
    return {"attempts": logs[0].attempts, "samples_trained": logs[0].samples_trained}
