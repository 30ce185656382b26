"""The optimizer and learning-rate scheduler of every task, built in one place.

`task.module.optimizer` and `task.module.scheduler` are partial configs (`_partial_: true`):
the optimizer is called with the parameters, the scheduler with the optimizer. Any
`torch.optim.lr_scheduler` class fits. A scheduler whose length is the run's length gets it
when the config leaves it out: OneCycleLR's `total_steps` and CosineAnnealingLR's `T_max`
are the number of scheduler steps of the run (optimizer steps with `scheduler_interval:
step`, epochs with `epoch`). ReduceLROnPlateau steps on the task's monitored metric
(`task.monitor`), and its `mode` is the task's `monitor_mode` when the config leaves it out.
Others (StepLR, ExponentialLR, ...) take their config as it is.
"""

from __future__ import annotations

import inspect
import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, cast

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
    monitor: tuple[str, str] | None = None,
) -> Any:
    """What `LightningModule.configure_optimizers` returns; `monitor` is the task's
    (metric, mode), which a ReduceLROnPlateau scheduler steps on."""
    if optimizer is None:
        raise ConfigError(
            "task.module.optimizer", None, "an optimizer to train with", "e.g. the task's default"
        )
    built = optimizer(parameters)
    if scheduler is None:
        return built
    missing = _missing_run_length_args(scheduler)
    length = _run_length(trainer, interval, scheduler) if missing else 0
    filled: dict[str, Any] = dict.fromkeys(missing, length)
    config: dict[str, Any] = {"interval": interval}
    if _steps_on_a_metric(scheduler):
        metric, mode = _plateau_monitor(monitor, interval)
        config["monitor"] = metric
        if "mode" not in getattr(scheduler, "keywords", {}):
            filled["mode"] = mode
    config["scheduler"] = scheduler(built, **filled)
    return {"optimizer": built, "lr_scheduler": config}


def _steps_on_a_metric(scheduler: SchedulerFactory) -> bool:
    factory = getattr(scheduler, "func", scheduler)
    return inspect.isclass(factory) and issubclass(
        factory, torch.optim.lr_scheduler.ReduceLROnPlateau
    )


def _plateau_monitor(monitor: tuple[str, str] | None, interval: str) -> tuple[str, str]:
    if monitor is None:
        raise ConfigError(
            "task.module.scheduler._target_",
            "ReduceLROnPlateau",
            "a scheduler for a module built from a task config (it steps on task.monitor)",
            "build the module with build.build_task, or use another scheduler",
        )
    if interval != "epoch":
        raise ConfigError(
            "task.module.scheduler_interval",
            interval,
            f"epoch with ReduceLROnPlateau: it steps on {monitor[0]}, measured at each "
            "validation, not after every optimizer step",
            "add task.module.scheduler_interval=epoch",
        )
    return monitor


def _missing_run_length_args(scheduler: SchedulerFactory) -> list[str]:
    given = getattr(scheduler, "keywords", {})
    parameters = inspect.signature(scheduler).parameters
    return [name for name in RUN_LENGTH_ARGS if name in parameters and name not in given]


def _run_length(trainer: L.Trainer, interval: str, scheduler: SchedulerFactory) -> int:
    steps = trainer.estimated_stepping_batches if interval == "step" else trainer.max_epochs
    if steps is None or steps == float("inf") or steps < 1:
        name = getattr(getattr(scheduler, "func", scheduler), "__name__", "the scheduler")
        raise ConfigError(
            "trainer.max_epochs",
            trainer.max_epochs,
            f"a number of epochs >= 1 with {name}, whose length is the run's "
            f"({', '.join(_missing_run_length_args(scheduler))}): -1 (no end) leaves it none",
            "bound the run and let early stopping end it sooner (callbacks=early_stopping "
            "trainer.max_epochs=100), or set trainer.max_steps, or use a scheduler without a "
            "length (task.module.scheduler=null, StepLR, ReduceLROnPlateau)",
        )
    return int(steps)


def drop_run_length_state(checkpoint: dict[str, Any]) -> None:
    """Before Lightning restores the schedulers of a resumed run (see RUN_LENGTH_STATE)."""
    for state in checkpoint.get("lr_schedulers", []):
        for name in RUN_LENGTH_STATE:
            state.pop(name, None)


def fit_schedule_to_resumed_run(
    trainer: L.Trainer, module: L.LightningModule, epoch: int, batches_done: int
) -> None:
    """A run resumed in `epoch` with `batches_done` of its batches at this world size and
    batch size counted done: a schedule counted in steps continues as an uninterrupted run
    of this shape would from that place (docs/resume.md): its length is that run's, the
    steps it had taken there its step count, and the learning rates (momentum too) its
    values at that step. At the shape the checkpoint was saved at nothing changes; at
    another, OneCycleLR would otherwise step past its end (and raise) or end early."""
    factory = getattr(module, "scheduler_factory", None)
    if factory is None or getattr(module, "scheduler_interval", None) != "step":
        return
    missing = _missing_run_length_args(factory)
    endless = trainer.max_epochs is None or trainer.max_epochs < 1
    if not missing or endless or trainer.num_training_batches == float("inf"):
        return
    done, left = _steps_of_this_shape(trainer, epoch, batches_done)
    length = done + left
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        lengths_agree = all(getattr(scheduler, name, length) == length for name in missing)
        if lengths_agree and getattr(scheduler, "last_epoch", done) == done:
            continue
        _rebuild_at(
            cast(torch.optim.lr_scheduler.LRScheduler, scheduler), factory, missing, length, done
        )


def _rebuild_at(
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    factory: SchedulerFactory,
    missing: list[str],
    length: int,
    done: int,
) -> None:
    """The same schedule built for `length` steps on a stand-in optimizer (building it on
    the real one would reset its state) and stepped `done` times from the start, as the
    uninterrupted run stepped it: the same values, bit for bit (torch's schedulers compute
    some recursively, CosineAnnealingLR among them). Its state and the hyperparameters it
    sets (lr, momentum) move over to the real scheduler and optimizer. The stepping costs
    a few microseconds a step, once per resume at another shape."""
    optimizer = scheduler.optimizer
    groups = [
        {
            **{k: v for k, v in group.items() if k != "params"},
            # Where the uninterrupted run's optimizer started.
            "lr": group.get("initial_lr", group["lr"]),
            "params": [torch.zeros(1)],
        }
        for group in optimizer.param_groups
    ]
    # Optimizer classes take their parameter groups first (the base class also defaults).
    stand_in = cast(Any, type(optimizer))(groups)
    with warnings.catch_warnings():
        # "lr_scheduler.step() before optimizer.step()": the stand-in never steps.
        warnings.simplefilter("ignore", UserWarning)
        fresh = factory(stand_in, **dict.fromkeys(missing, length))
        for _ in range(done):
            fresh.step()
    scheduler.load_state_dict(fresh.state_dict())
    for group, built in zip(optimizer.param_groups, stand_in.param_groups, strict=True):
        group.update({k: v for k, v in built.items() if k != "params"})


def _steps_of_this_shape(trainer: L.Trainer, epoch: int, batches_done: int) -> tuple[int, int]:
    """(steps an uninterrupted run at this world size and batch size had taken at this
    place, steps this attempt takes to the run's end, `max_steps` included)."""
    batches = int(trainer.num_training_batches)
    accumulate = trainer.accumulate_grad_batches
    per_epoch = math.ceil(batches / accumulate)
    max_epochs = int(cast(int, trainer.max_epochs))
    this_epoch_left = math.ceil(max(batches - batches_done, 0) / accumulate)
    left = this_epoch_left + max(max_epochs - epoch - 1, 0) * per_epoch
    if trainer.max_steps != -1:
        left = min(left, max(trainer.max_steps - trainer.global_step, 0))
    done = min(epoch, max_epochs) * per_epoch + per_epoch - this_epoch_left
    return done, left
