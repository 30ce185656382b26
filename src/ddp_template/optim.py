"""The optimizer and learning-rate scheduler of every task, built in one place.

`task.module.optimizer` and `task.module.scheduler` are partial configs (`_partial_: true`):
the optimizer is called with the parameters, the scheduler with the optimizer. Any
`torch.optim.lr_scheduler` class fits. A scheduler whose length is the run's length gets it
when the config leaves it out: OneCycleLR's `total_steps` and CosineAnnealingLR's `T_max`
are the number of scheduler steps of the run (optimizer steps with `scheduler_interval:
step`, epochs with `epoch`). Others (StepLR, ExponentialLR, ...) take their config as it is.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from typing import Any

import lightning as L
import torch

from ddp_template.errors import ConfigError

OptimizerFactory = Callable[..., torch.optim.Optimizer]
SchedulerFactory = Callable[..., torch.optim.lr_scheduler.LRScheduler]

INTERVALS = ("step", "epoch")
# Arguments that are the length of the run, filled in when the config leaves them out.
RUN_LENGTH_ARGS = ("total_steps", "T_max")
# What a scheduler's saved state holds that follows from the run's length: a resumed run
# keeps the length it computed itself, so that more epochs stretch the schedule instead of
# stepping past its end (OneCycleLR raises "Tried to step ... times").
RUN_LENGTH_STATE = (*RUN_LENGTH_ARGS, "_schedule_phases")


def check_interval(interval: object) -> None:
    if interval not in INTERVALS:
        raise ConfigError(
            "task.module.scheduler_interval",
            interval,
            "step (the scheduler steps after every optimizer step) or epoch (after every epoch)",
            "e.g. task.module.scheduler_interval=epoch for StepLR counted in epochs",
        )


def configure(
    parameters: Iterable[torch.nn.Parameter],
    optimizer: OptimizerFactory | None,
    scheduler: SchedulerFactory | None,
    interval: str,
    trainer: L.Trainer,
) -> Any:
    """What `LightningModule.configure_optimizers` returns."""
    if optimizer is None:
        raise ConfigError(
            "task.module.optimizer", None, "an optimizer to train with", "e.g. the task's default"
        )
    built = optimizer(parameters)
    if scheduler is None:
        return built
    missing = _missing_run_length_args(scheduler)
    length = _run_length(trainer, interval) if missing else 0
    lr_scheduler = scheduler(built, **dict.fromkeys(missing, length))
    return {
        "optimizer": built,
        "lr_scheduler": {"scheduler": lr_scheduler, "interval": interval},
    }


def _missing_run_length_args(scheduler: SchedulerFactory) -> list[str]:
    given = getattr(scheduler, "keywords", {})
    parameters = inspect.signature(scheduler).parameters
    return [name for name in RUN_LENGTH_ARGS if name in parameters and name not in given]


def _run_length(trainer: L.Trainer, interval: str) -> int:
    if interval == "step":
        return int(trainer.estimated_stepping_batches)
    if trainer.max_epochs is None or trainer.max_epochs < 1:
        raise ConfigError(
            "task.module.scheduler_interval",
            interval,
            "epoch only with a number of epochs (trainer.max_epochs >= 1): the scheduler's "
            "length is counted in epochs",
            "use task.module.scheduler_interval=step, or set trainer.max_epochs",
        )
    return int(trainer.max_epochs)


def drop_run_length_state(checkpoint: dict[str, Any]) -> None:
    """Before Lightning restores the schedulers of a resumed run (see RUN_LENGTH_STATE)."""
    for state in checkpoint.get("lr_schedulers", []):
        for name in RUN_LENGTH_STATE:
            state.pop(name, None)
