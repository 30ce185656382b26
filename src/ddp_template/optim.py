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


def fit_schedule_to_resumed_run(trainer: L.Trainer, module: L.LightningModule, epoch: int) -> None:
    """A run resumed in `epoch` (after Lightning counted that epoch's batches done): its
    schedule, counted in steps, lasts the run's real length, the steps done before plus those
    left at this run's world size and batch size. At the same world size and batch size that
    is the length the scheduler was built with (nothing changes); at another, OneCycleLR would
    otherwise end too early or step past its end (and raise)."""
    factory = getattr(module, "scheduler_factory", None)
    if factory is None or getattr(module, "scheduler_interval", None) != "step":
        return
    missing = _missing_run_length_args(factory)
    endless = trainer.max_epochs is None or trainer.max_epochs < 1
    if not missing or endless or trainer.num_training_batches == float("inf"):
        return
    length = trainer.global_step + _steps_left(trainer, epoch)
    if trainer.max_steps != -1:
        length = min(length, trainer.max_steps)
    for config in trainer.lr_scheduler_configs:
        scheduler = config.scheduler
        if all(getattr(scheduler, name, length) == length for name in missing):
            continue
        # The same schedule built for that length on a stand-in optimizer (building it on
        # the real one would reset its learning rates); its length-derived state moves over.
        optimizer = scheduler.optimizer
        groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [torch.zeros(1)]}
            for group in optimizer.param_groups
        ]
        # Optimizer classes take their parameter groups first (the base class also defaults).
        stand_in = cast(Any, type(optimizer))(groups)
        fresh = factory(stand_in, **dict.fromkeys(missing, length)).state_dict()
        for name in RUN_LENGTH_STATE:
            if name in fresh:
                setattr(scheduler, name, fresh[name])


def _steps_left(trainer: L.Trainer, epoch: int) -> int:
    batches = int(trainer.num_training_batches)
    per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
    done = trainer.fit_loop.epoch_loop.batch_progress.current.ready
    epochs_after = max(int(cast(int, trainer.max_epochs)) - epoch - 1, 0)
    this_epoch = math.ceil(max(batches - done, 0) / trainer.accumulate_grad_batches)
    return this_epoch + epochs_after * per_epoch
